"""The slices of sequence parallelism (app/core/sequence_step.py): each slice's targets, and the slices' shares of
next-token losses and of answers' log-probabilities adding up to the whole sequence's. The group's sum is
tests/e2e/test_dist.py's; the runs are tests/e2e/test_sequence_parallel.py's."""
import torch

from app.core import sequence_step
from app.core.fused_loss import target_logps
from app.core.reference import answer_logps, counted_at_least_one
from app.core.tasks import next_token_correct, next_token_loss
from app.data.chat import IGNORE


def test_the_slices_cover_the_sequence_each_token_predicting_the_next_across_the_cut():
    ids = torch.arange(1, 8).repeat(2, 1)  # 7 tokens: padded to 8 for 2 ranks
    labels = ids.clone()
    labels[1, :3] = IGNORE  # a prompt
    parts = [sequence_step.sliced([ids, None], labels, 2, rank) for rank in (0, 1)]
    assert parts[0][0].tolist()[0] == [1, 2, 3, 4] and parts[1][0].tolist()[0] == [5, 6, 7, 0]
    assert parts[0][1].tolist()[0] == [0, 1, 2, 3] and parts[1][1].tolist()[0] == [4, 5, 6, 6], \
        "the padding sits at the last real position: never past a learned position table (GPT-2's 1,024 at SP=3)"
    assert parts[0][2].tolist()[0] == [2, 3, 4, 5], "the slice's last token predicts the next slice's first"
    assert parts[1][2].tolist()[0] == [6, 7, IGNORE, IGNORE], "the last token and the padding predict nothing"
    assert parts[0][2].tolist()[1] == [IGNORE, IGNORE, 4, 5]
    assert sequence_step.counted(labels).tolist() == [6, 4]


def _slices(logits, labels, degree=2):
    """[(this rank's logits, its targets)] of each rank: the logits padded as the ids are (never counted)."""
    length = -(-logits.shape[1] // degree) * degree
    whole = torch.nn.functional.pad(logits, (0, 0, 0, length - logits.shape[1]))
    return [(whole[:, rank * length // degree:(rank + 1) * length // degree],
             sequence_step.sliced([labels], labels, degree, rank)[2]) for rank in range(degree)]


def test_the_slices_losses_and_right_answers_add_up_to_the_whole_sequences():
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 7, 11), torch.randint(0, 11, (2, 7))
    labels[0, :2] = IGNORE
    shares, right = torch.zeros(2), torch.zeros(2)
    for part, targets in _slices(logits, labels):
        losses = torch.nn.functional.cross_entropy(part.flatten(0, 1), targets.flatten(), reduction="none",
                                                   ignore_index=IGNORE)
        shares += losses.view(2, -1).sum(1) / sequence_step.counted(labels)
        right += ((part.argmax(-1) == targets) & (targets != IGNORE)).sum(1) / sequence_step.counted(labels)
    assert torch.allclose(shares, next_token_loss(logits, labels), atol=1e-6)
    assert torch.allclose(right, next_token_correct(logits, labels), atol=1e-6)


def test_the_slices_answer_log_probabilities_and_counts_add_up_to_the_whole_answers():
    """A preference pair's answers over 3 slices: one slice holds no answer token of the first row (its count 0,
    taken as 1 only once summed), the second row has none at all."""
    torch.manual_seed(1)
    logits, labels = torch.randn(2, 9, 13), torch.randint(0, 13, (2, 9))
    labels[0, :5] = IGNORE
    labels[1] = IGNORE
    sums = [target_logps(part, targets) for part, targets in _slices(logits, labels, 3)]
    assert sums[0][0, 1] == 0, "the first slice holds only the first row's prompt"
    whole = counted_at_least_one(sum(sums))
    assert torch.allclose(whole, answer_logps(logits, labels), atol=1e-5)
    assert whole[:, 1].tolist() == [4, 1]
