"""GRPO's arithmetic (app/core/grpo_loss.py) against TRL's formulas, and the property the step rests on: a window's
loss is the same however its prompts are split over micro batches, accumulation and ranks."""
import math

import pytest
import torch

from app.core import grpo_loss

NAN = float("nan")


def test_rewards_combine_by_weight_and_none_is_left_out_unless_every_function_says_it():
    rewards = torch.tensor([[1.0, 2.0], [NAN, 2.0], [NAN, NAN]], dtype=torch.float64)
    found = grpo_loss.combined(rewards, [0.5, 2.0])
    assert found[:2].tolist() == [4.5, 4.0] and math.isnan(found[2])


def test_advantages_are_centred_on_the_group_and_scaled_as_asked():
    r = torch.tensor([1.0, 3.0, 0.0, 0.0, 2.0, NAN], dtype=torch.float64)
    std = math.sqrt(2.0)  # group 1: [1, 3], n - 1
    group = grpo_loss.advantages(r, 2, "group", NAN)
    assert group[:2].tolist() == pytest.approx([-1 / (std + 1e-4), 1 / (std + 1e-4)])
    assert group[2:4].tolist() == [0.0, 0.0], "a group that all agrees teaches nothing"
    assert group[4:].tolist() == [0.0, 0.0], "one scored completion: no std, and the unscored one gets 0"
    assert grpo_loss.advantages(r, 2, "batch", 2.0)[:2].tolist() == pytest.approx([-1 / 2.0001, 1 / 2.0001])
    assert grpo_loss.advantages(r, 2, "none", NAN)[:2].tolist() == [-1.0, 1.0]


def test_the_token_loss_is_trls_clipped_objective_with_the_k3_kl():
    logp = torch.log(torch.tensor([[0.5, 0.25]]))
    old = torch.log(torch.tensor([[0.25, 0.25]]))  # ratio 2 on the first token, 1 on the second
    loss, kl, below, above = grpo_loss.token_losses(logp, old, torch.tensor([1.0]), 0.2, 0.28, 0.0)
    assert loss[0].tolist() == pytest.approx([-1.28, -1.0]) and kl is None
    assert above.tolist() == [[1.0, 0.0]] and below.tolist() == [[0.0, 0.0]]
    reference = torch.log(torch.tensor([[0.25, 0.25]]))
    loss, kl, _, _ = grpo_loss.token_losses(logp, logp, torch.tensor([-1.0]), 0.2, 0.2, 0.5, reference)
    gap = math.log(0.5)
    assert kl[0].tolist() == pytest.approx([math.exp(gap) - gap - 1, 0.0])
    assert loss[0].tolist() == pytest.approx([1 + 0.5 * (math.exp(gap) - gap - 1), 1.0])


def test_token_log_probabilities_are_read_where_each_completion_sits_after_its_prompt():
    torch.manual_seed(0)
    logits = torch.randn(2, 7, 5)
    completions, starts = torch.tensor([[1, 4], [3, 0]]), torch.tensor([3, 5])
    found = grpo_loss.token_logps(logits, completions, starts, 0.5)
    expected = torch.stack([torch.stack([(logits[r, starts[r] - 1 + t] / 0.5).log_softmax(-1)[completions[r, t]]
                                         for t in range(2)]) for r in range(2)])
    assert torch.allclose(found, expected)


def _window(prompts: int, group: int, length: int):
    torch.manual_seed(1)
    loss = torch.randn(prompts * group, length, dtype=torch.float64)
    mask = (torch.rand(prompts * group, length) < 0.7).double()
    mask[3] = 0.0  # a completion the loss leaves out (truncated and masked)
    return loss, mask


def _objective(kind: str, loss, mask, length: int) -> float:
    """The window's loss as TRL states it over the whole generation batch."""
    if kind == "dapo":
        return float((loss * mask).sum() / mask.sum())
    if kind == "grpo":
        return float(((loss * mask).sum(1) / mask.sum(1).clamp(min=1)).mean())
    return float((loss * mask).sum() / (len(loss) * length))


@pytest.mark.parametrize("kind", grpo_loss.LOSSES)
@pytest.mark.parametrize("micro, accumulation, ranks", [(4, 1, 2), (1, 4, 2), (8, 1, 1), (2, 2, 2)])
def test_a_windows_loss_does_not_depend_on_how_it_is_split(kind, micro, accumulation, ranks):
    """DeepSpeed divides each micro batch's loss by the accumulation and averages over the ranks; with the loader's
    weight W x A / N per prompt, the micro batches' losses give the window's objective exactly."""
    group, length, prompts = 3, 5, 8
    loss, mask = _window(prompts, group, length)
    scale = ranks * accumulation
    per_token = scale / float(mask.sum())
    total = 0.0
    for k in range(prompts // micro):
        rows = torch.arange(k * micro * group, (k + 1) * micro * group)
        share = torch.full((len(rows),), scale / prompts / group, dtype=torch.float64)
        total += float(grpo_loss.normalised(kind, loss[rows], mask[rows], share, per_token, length))
    assert total / scale == pytest.approx(_objective(kind, loss, mask, length), abs=1e-12)


def test_padding_prompts_weigh_nothing():
    loss, mask = _window(2, 2, 3)
    share = torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64)
    for kind in grpo_loss.LOSSES:
        kept = grpo_loss.normalised(kind, loss[:2], mask[:2], share[:2], 0.25, 3)
        assert float(grpo_loss.normalised(kind, loss, mask, share, 0.25, 3)) == pytest.approx(float(kept))
