"""The parts of the app's changes to DeepSpeed's step (app/ds/internals/engine.py) that need no engine."""
from types import SimpleNamespace

import pytest
import torch
from deepspeed.runtime.utils import is_invalid_grad_norm

from app.ds.internals.engine import (BadNorms, _deciding_on_device, _norm_check_on_device,
                                     count_every_stage_in_grad_norm, count_skipped_steps, forget_parallel_groups,
                                     forget_unfinished_forward)

NORMS = [torch.tensor(1.5), torch.tensor(0.0), torch.tensor(float("inf")), torch.tensor(float("nan")),
         torch.tensor(-1.0), torch.tensor([2.0, float("-inf")]), torch.tensor(3.0, dtype=torch.bfloat16)]


def test_bad_norms_keep_the_latest_verdict_and_count_the_skipped_steps():
    norms = BadNorms(torch.device("cpu"))
    for verdict in (0.0, 1.0, 1.0, 0.0):
        assert norms.record(torch.tensor(verdict)).item() == verdict
    assert norms.last.item() == 0 and norms.skipped.item() == 2
    norms.record(~torch.isfinite(torch.tensor(float("nan"))), skipped=False)  # ZeRO 0 in fp32: noted, not skipped
    assert norms.last.item() == 1 and norms.skipped.item() == 2


def test_outside_the_apps_step_the_norm_check_answers_as_deepspeeds():
    check = _norm_check_on_device(is_invalid_grad_norm)
    assert check.deepspeed_original is is_invalid_grad_norm
    for norm in [*NORMS, 3.0, float("nan"), -1.0]:
        assert check(norm) is is_invalid_grad_norm(norm), norm


@pytest.fixture
def deciding():
    """The state of a ZeRO step the app decides on the device: its fused optimizer and its BadNorms."""
    inner = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], fused=True)
    norms = BadNorms(torch.device("cpu"))
    _deciding_on_device.append((inner, norms))
    try:
        yield inner, norms
    finally:
        _deciding_on_device.pop()


def test_inside_the_step_the_host_hears_valid_and_the_optimizer_gets_deepspeeds_verdict(deciding):
    inner, norms = deciding
    check = _norm_check_on_device(is_invalid_grad_norm)
    for norm in NORMS:
        inner.found_inf = None  # as each step of the app's leaves it
        assert check(norm) is False and check(norm) is False  # the step's ask, then the clip's guard
        assert inner.found_inf.shape == () and inner.found_inf.dtype == torch.float32
        assert bool(inner.found_inf) is is_invalid_grad_norm(norm), norm
    assert norms.skipped.item() == sum(is_invalid_grad_norm(norm) for norm in NORMS), "each step counted once"


def test_a_bad_verdict_leaves_weights_moments_and_step_count_as_deepspeeds_skipped_step_does():
    """What the step decided on the device rests on: torch's fused AdamW reads found_inf in its kernel."""
    torch.manual_seed(0)
    start = torch.randn(6)
    ours, stock = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    fused = torch.optim.AdamW([ours], lr=0.1, fused=True)
    reference = torch.optim.AdamW([stock], lr=0.1, fused=True)
    assert fused._step_supports_amp_scaling, "skip_bad_steps_on_device would leave the step to the host"
    for bad in (False, True, False, True, False):
        grad = torch.randn(6) / (0.0 if bad else 1.0)
        ours.grad, stock.grad = grad.clone(), grad.clone()
        fused.found_inf = torch.tensor(float(bad))
        fused.step()
        fused.found_inf = None
        if not bad:
            reference.step()  # DeepSpeed's host check skips the bad step
    assert torch.equal(ours, stock)
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(fused.state[ours][key], reference.state[stock][key]), key


def _scheduler():
    from deepspeed.runtime.lr_schedules import WarmupDecayLR
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    return WarmupDecayLR(optimizer, total_num_steps=20, warmup_num_steps=6, warmup_max_lr=0.1)


def test_steps_skipped_on_the_device_give_deepspeeds_count_and_learning_rate_at_each_log_row():
    """DeepSpeed holds its schedule back on a step it skips; the app's step advanced it and catches up at log rows."""
    stock, engine = _scheduler(), SimpleNamespace(skipped_steps=0, lr_scheduler=_scheduler())
    stock_skipped = since_row = 0
    bad = [False, True, False, False, True, True, False, False, False]
    for step, skipped in enumerate(bad, 1):
        if skipped:
            stock_skipped += 1
        else:
            stock.step()
        engine.lr_scheduler.step()
        since_row += skipped
        if step % 3 == 0:  # a log row
            count_skipped_steps(engine, since_row)
            since_row = 0
            assert engine.skipped_steps == stock_skipped
            assert engine.lr_scheduler.last_batch_iteration == stock.last_batch_iteration
            assert engine.lr_scheduler.get_last_lr() == stock.get_last_lr(), step
    assert stock_skipped == 3


def test_every_pipeline_stage_counts_its_own_parameters_in_the_norm_and_a_tied_copy_once():
    """DeepSpeed's clip adds a parameter of a stage after the first only when it is model parallel by its own test."""
    from deepspeed.runtime.utils import is_model_parallel_parameter
    stage = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 2))
    stage[1].weight.ds_pipe_replicated = True  # a tied layer's copy: the stage that owns it counts it
    assert not any(is_model_parallel_parameter(p) for p in stage.parameters())
    count_every_stage_in_grad_norm(stage)
    assert [is_model_parallel_parameter(p) for p in stage.parameters()] == [True, True, False, True]


def test_a_pipelines_grid_and_an_unfinished_forward_are_let_go_where_deepspeed_keeps_them(monkeypatch):
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.utils import groups
    monkeypatch.setattr(groups, "mpu", SimpleNamespace(name="a pipeline's grid"))  # fails on a name DeepSpeed dropped
    monkeypatch.setattr(parameter_offload, "FWD_MODULE_STACK", [torch.nn.Linear(1, 1)])
    forget_parallel_groups()
    forget_unfinished_forward()
    assert groups.mpu is None and parameter_offload.FWD_MODULE_STACK == []
