"""GRPO's step on a sequence-parallel rank (app/core/grpo_sequence.py), without ranks: each slice's completion
tokens and their log-probabilities add up to the whole sequences'. The runs against one process are
tests/e2e/test_sequence_parallel.py's."""
from types import SimpleNamespace

import pytest
import torch

from app.core import grpo_loss
from app.core.grpo_sequence import SequenceGrpoStep
from app.core.sequence_step import Group


def step_of(rank: int, degree: int, temperature: float) -> SequenceGrpoStep:
    """The step of `rank` of a group of `degree`, as far as its slice's arithmetic goes (no engine)."""
    step = object.__new__(SequenceGrpoStep)
    step.group = object.__new__(Group)
    step.group.degree, step.group.rank = degree, rank
    step.task = SimpleNamespace(how=SimpleNamespace(temperature=temperature))
    return step


@pytest.mark.parametrize("degree", [2, 3, 4])
def test_the_slices_take_each_completion_token_once_and_its_log_probability_as_the_whole_sequence_gives_it(degree):
    """A model whose logits at each position depend on that position's token and place alone (as a slice's do on
    what it holds): 3 sequences of 11 tokens (padded for the slices), prompts of 2, 4 and 7 tokens, completions
    of 4; one completion's first token predicted by the last position of a slice. Each rank's softmax runs over a
    window of its slice, 0 for the tokens it does not predict."""
    torch.manual_seed(0)
    vocab, width = 17, 11
    table, places = torch.randn(vocab, vocab), torch.randn(16, vocab)
    logits = lambda ids, positions: table[ids] + places[positions]  # noqa: E731
    ids = torch.randint(0, vocab, (3, width))
    starts, completions = torch.tensor([2, 4, 7]), torch.randint(0, vocab, (3, 4))
    whole = grpo_loss.token_logps(logits(ids, torch.arange(width).expand(3, -1)), completions, starts, 0.7)
    taken, summed = torch.zeros(3, 4), torch.zeros(3, 4)
    for rank in range(degree):
        step = step_of(rank, degree, 0.7)
        mine = step.mine((ids, completions, starts))
        found = step.log_probs((ids, completions, starts), logits)
        assert (found[~mine] == 0).all(), "nothing for the tokens another slice predicts"
        taken += mine
        summed += found
    assert taken.tolist() == [[1.0] * 4] * 3, "every completion token on one slice alone"
    assert torch.allclose(summed, whole, atol=1e-6)


@pytest.mark.parametrize("n, degree", [(3, 2), (5, 3), (1, 2), (4, 2)])
def test_the_group_scores_each_completion_once_and_its_padding_never(n, degree):
    """Each rank samples its share of the rows whole; the last share is padded with repeats of the last row (the
    group's gather takes one shape), which are sampled but not scored: the reward functions see each completion
    once over the group, and a rank whose share is all padding calls none."""
    from app.core.rewards import Asked
    asked = Asked([f"prompt {i}" for i in range(n)], {"answer": [str(i) for i in range(n)]},
                  [f"row {i}" for i in range(n)])
    prompts, lengths, u = torch.arange(n)[:, None].repeat(1, 3), torch.full((n,), 3), torch.rand(n, 4)
    named, gathered = [], []
    for rank in range(degree):
        step = step_of(rank, degree, 1.0)
        step.task.rewards, step.engine = ["one function"], SimpleNamespace(device=torch.device("cpu"))
        step.sample = lambda p, lengths, u, how: (p, torch.ones_like(p, dtype=torch.bool),
                                                  torch.zeros(len(p), dtype=torch.bool))
        step.scored = lambda c, m, a: (named.extend(a.names) or c[:, :1].double() + 1, [])
        step.group.gather = lambda x: gathered.append(x) or torch.cat([x] * degree)
        step.decoded = lambda c, m: ([], [""] * len(c))
        step.roll(prompts, lengths, u, None, asked)
        share = -(-n // degree)
        rows = [min(i, n - 1) for i in range(rank * share, (rank + 1) * share)]
        assert gathered[-1].squeeze(1).tolist() == [r + 1.0 if i < n else 0.0 for i, r in
                                                    zip(range(rank * share, (rank + 1) * share), rows)]
    assert named == [f"row {i}" for i in range(n)], "each completion scored once, in order"
