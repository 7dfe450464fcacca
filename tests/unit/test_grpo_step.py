"""The GRPO step's pieces that need no engine (app/core/grpo_step.py): the sequences it trains on, and the window's
totals its loss and metrics divide by (one rank here; the e2e tests sum them over two)."""
import math

import pytest
import torch

from app.core import grpo_step
from app.core.rewards import Reward

NAN = float("nan")


def test_each_sequence_is_its_prompts_own_tokens_then_its_completion_right_padded():
    prompts = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 4]])  # left-padded with 0
    completions = torch.tensor([[1, 2, 3], [4, 0, 0]])
    found = grpo_step.sequences(prompts, torch.tensor([2, 4]), completions, 0)
    assert found.tolist() == [[5, 6, 1, 2, 3, 0, 0], [7, 8, 9, 4, 4, 0, 0]]


def _part(rewards, mask, share, truncated):
    n = len(rewards)
    return grpo_step.Part(torch.zeros(n, 2, dtype=torch.long), torch.ones(n, dtype=torch.long),
                          torch.zeros(n, mask.shape[1], dtype=torch.long), mask, share,
                          torch.tensor(rewards, dtype=torch.float64), truncated, mask.sum(1))


def test_the_windows_totals_count_real_prompts_alone_and_give_trls_reward_metrics():
    functions = [Reward("a", None, 1.0, ""), Reward("b", None, 0.5, "")]
    mask = torch.tensor([[1.0, 1.0, 0.0]] * 4)
    first = _part([[1.0, 0.0], [0.0, 0.0], [1.0, 2.0], [1.0, 2.0]], mask, torch.tensor([0.25] * 4),
                  torch.tensor([False] * 4))
    padding = _part([[9.0, 9.0], [9.0, 9.0]], mask[:2], torch.tensor([0.0, 0.0]), torch.tensor([True, True]))
    second = _part([[NAN, NAN], [0.0, NAN]], mask[:2], torch.tensor([0.25, 0.25]), torch.tensor([False, False]))
    totals = grpo_step.window_totals([first, padding, second], 2, functions)
    assert totals["tokens"] == 12.0, "six real completions of two tokens; padding left out"
    rewards = [1.0, 0.0, 2.0, 2.0, 0.0]  # the weighted sums; the completion every function left out is not one
    shown = totals["shown"]
    assert shown["reward"] == pytest.approx(sum(rewards) / 5)
    assert shown["rewards/a/mean"] == pytest.approx(3 / 5) and shown["rewards/b/mean"] == pytest.approx(4 / 4)
    assert shown["frac_reward_zero_std"] == pytest.approx(1 / 3), "group 2 agrees; group 3 has one score: no std"
    mean = sum(rewards) / 5
    assert totals["batch_std"] == pytest.approx(math.sqrt(sum((r - mean) ** 2 for r in rewards) / 4))
    assert shown["reward_std"] == totals["batch_std"], "TRL's reward_std: the std of every reward of the step"


@pytest.mark.parametrize("value", [0.15, 0.3, 0.7])
def test_a_step_whose_completions_all_score_alike_has_a_batch_std_of_zero_not_a_complex_one(value):
    """Rounding can take the variance of equal rewards a hair below zero; its square root must stay real."""
    n = 128
    part = _part([[value]] * n, torch.ones(n, 2), torch.full((n,), 1 / 8), torch.tensor([False] * n))
    std = grpo_step.window_totals([part], 8, [Reward("a", None, 1.0, "")])["batch_std"]
    assert isinstance(std, float) and std == pytest.approx(0.0, abs=1e-7)
