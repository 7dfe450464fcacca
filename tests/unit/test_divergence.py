"""A run that diverges: streaks of bad steps end it at a log row, and weights not finite are never saved."""
from types import SimpleNamespace

import pytest
import torch

from app.core.divergence import Divergence
from app.ds.internals.engine import BadNorms
from app.errors import UserError


class _Engine:
    """What Divergence reads of DeepSpeed's engine: its step counters, whether the last step was applied, its
    weights, and the device's record of bad gradient norms where the app checks them there."""

    def __init__(self, bf16=False, norms_on_device=True, loss_scaler=None):
        self.device, self.module, self.bf16 = torch.device("cpu"), torch.nn.Linear(3, 1), bf16
        self.optimizer = SimpleNamespace(loss_scaler=loss_scaler)  # fp16's (DeepSpeed's own class), or none
        self.global_steps, self.skipped_steps, self.applied, self.lr_scheduler = 0, 0, True, None
        if norms_on_device:
            self.app_bad_norms = BadNorms(self.device)

    def was_step_applied(self) -> bool:
        return self.applied

    def bfloat16_enabled(self) -> bool:
        return self.bf16

    def fp16_enabled(self) -> bool:
        return self.optimizer.loss_scaler is not None


def _steps(divergence: Divergence, kinds: str):
    """One optimizer step per letter: g good, l loss not finite, s skipped by DeepSpeed, n gradient norm not
    finite (skipped on the device)."""
    engine = divergence.engine
    for kind in kinds:
        engine.global_steps += 1
        engine.applied = kind != "s"
        if divergence.norms is not None:
            divergence.norms.record(torch.tensor(kind == "n"))
        divergence.stepped(torch.tensor(kind == "l"))


def _line(caught) -> str:
    message = str(caught.value)
    assert "\n" not in message, message
    return message


def test_a_streak_of_bad_steps_of_any_kind_ends_the_run_naming_since_when():
    divergence = Divergence(_Engine(), limit=3)
    _steps(divergence, "ggl")
    assert divergence.check() == 0
    _steps(divergence, "sn")
    with pytest.raises(UserError) as caught:
        divergence.check()
    assert _line(caught) == (
        "the run diverged: its loss or gradient norm has not been finite since step 3 (now step 5; "
        "--max_nonfinite_steps 3); nothing was saved from these steps; lower the learning rate "
        "(optimizer.params.lr in the ds_config) or lengthen its warm-up, then run again with --resume auto (from "
        "the newest checkpoint, which holds finite weights, if any)")


def test_a_good_step_starts_the_count_again():
    divergence = Divergence(_Engine(), limit=3)
    _steps(divergence, "llgllgll")
    divergence.check()
    _steps(divergence, "l")
    with pytest.raises(UserError, match="since step 7 \\(now step 9;"):
        divergence.check()


def test_a_streak_between_two_log_rows_is_not_missed_when_the_run_recovered_before_the_row():
    divergence = Divergence(_Engine(), limit=2)
    _steps(divergence, "gllggggg")
    with pytest.raises(UserError, match="since step 2 \\(now step 8;"):
        divergence.check()


def test_no_limit_never_ends_the_run_and_counts_what_was_skipped():
    divergence = Divergence(_Engine(norms_on_device=False), limit=0)
    _steps(divergence, "l" * 50)
    divergence.engine.skipped_steps = 7  # DeepSpeed's host check counts its own skipped steps
    assert divergence.check() == 7


def test_fp16_overflows_while_its_scale_searches_are_no_divergence():
    """From initial_scale_power 32 DeepSpeed's scaler skips about 18 steps in a row, halving the scale, before one
    applies: that is its search. Skipped at the minimum scale, the steps count."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    scaler = DynamicLossScaler(init_scale=2.0 ** 32, scale_window=1000, min_scale=1, delayed_shift=2,
                               consecutive_hysteresis=False)
    divergence = Divergence(_Engine(norms_on_device=False, loss_scaler=scaler), limit=10)
    for _ in range(18):
        _steps(divergence, "s")
        scaler.cur_scale /= 2
    _steps(divergence, "g" + "s" * 5)
    divergence.check()
    scaler.cur_scale = 1
    _steps(divergence, "s" * 9)
    divergence.check()
    _steps(divergence, "s")
    with pytest.raises(UserError, match="not been finite since step 25 "):
        divergence.check()
    plain = Divergence(_Engine(norms_on_device=False), limit=10)
    _steps(plain, "g" * 18 + "s" * 10)
    with pytest.raises(UserError, match="not been finite since step 19 "):
        plain.check()  # without fp16 every skipped step counts


def test_steps_skipped_on_the_device_reach_deepspeeds_count_once():
    engine = _Engine()
    divergence = Divergence(engine, limit=0)
    _steps(divergence, "nngn")
    assert divergence.check() == 3 and engine.skipped_steps == 3
    assert divergence.check() == 3, "read again: nothing new"
    _steps(divergence, "gn")
    assert divergence.check() == 4


def test_a_save_of_weights_that_are_not_finite_is_refused():
    engine = _Engine()
    divergence = Divergence(engine, limit=0)
    _steps(divergence, "ggg")
    divergence.before_save()
    with torch.no_grad():
        engine.module.weight[0, 1] = float("nan")
    with pytest.raises(UserError) as caught:
        divergence.before_save()
    assert _line(caught).startswith("the run diverged: its loss or gradient norm has not been finite at step 3 "
                                    "(now step 3; --max_nonfinite_steps 0); its weights are not finite; nothing "
                                    "was saved from these steps;")
    _steps(divergence, "gnl")
    with pytest.raises(UserError, match="not been finite since step 5 \\(now step 6;"):
        divergence.before_save()


def test_a_save_after_a_streak_that_hit_the_limit_is_refused_with_finite_weights():
    divergence = Divergence(_Engine(), limit=2)
    _steps(divergence, "gll")
    with pytest.raises(UserError) as caught:
        divergence.before_save()
    assert "since step 2 (now step 3; --max_nonfinite_steps 2); nothing was saved" in _line(caught)
    assert "weights are not finite" not in str(caught.value)


def test_a_bf16_run_is_offered_fp32_weights_too():
    divergence = Divergence(_Engine(bf16=True), limit=1)
    _steps(divergence, "l")
    with pytest.raises(UserError, match="or lengthen its warm-up, or keep fp32 weights \\(torch_autocast in place of "
                                        "the \"bf16\" section\\), then run again"):
        divergence.check()
