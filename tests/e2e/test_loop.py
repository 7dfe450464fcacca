"""Loop.run driving a real DeepSpeed engine in one spawned rank: when it logs, evaluates and saves, the position it
saves, resuming mid-epoch, an agreed stop. The schedule alone: tests/unit/test_loop.py."""
import json

import pytest

from app.core import loop
from conftest import engine_of, spawn_ranks

# lr 0 (no weight decay): the weights never change, so each step's loss depends on its batch alone
LOOP_CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
               "optimizer": {"type": "AdamW", "params": {"lr": 0.0, "weight_decay": 0.0, "torch_adam": True}}}
SCENARIOS = {  # name: (total steps, start, engine's step at start, stop at step, schedule intervals)
    "intervals": (7, (0, 0), 0, 0, dict(log_interval=2, save_interval=3)),
    "eval_interval": (7, (0, 0), 0, 0, dict(log_interval=10, eval_interval=2)),
    "whole": (7, (0, 0), 0, 0, dict(log_interval=1)),
    "resumed": (7, (1, 2), 5, 0, dict(log_interval=1)),  # saved at step 5: epoch 1, batch 2
    "stopped": (100, (0, 0), 0, 2, dict(log_interval=10, save_interval=50)),
    # 2 micro batches a step: epoch 0 ends inside step 2's window, where --keep_best saves its first evaluation
    "accumulated": (4, (0, 0), 0, 0, dict(log_interval=1), 2),
    "accumulated_resumed": (4, (0, 2), 1, 0, dict(log_interval=1), 2),  # from that save
}


class StopAt:
    """Every rank agrees to stop once the engine has reached step (the agreement itself is preemption's)."""

    def __init__(self, step, engine):
        self.step, self.engine = step, engine

    def agreed(self, step: int):
        return step >= self.step


def _fit(total, start, at_step, stop_at, intervals, accumulation=1):
    """(rows, saves, result) of Loop.run over 10 samples in micro batches of 4 (3 per epoch, the last padded);
    with accumulation > 1, --keep_best's early stopping judges each evaluation."""
    import torch
    from app.observe import runlog
    from app.core import tasks
    from app.core.early_stop import EarlyStopping
    from app.core.step import TrainStep
    from app.settings import Settings
    from app.data.loader import build_loader
    gen = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(10, 2, generator=gen), torch.randint(0, 3, (10,), generator=gen))
    train_loader = build_loader(data, 4, rank=0, world_size=1, shuffle=True, seed=3, accumulation=accumulation)
    eval_loader = build_loader(data, 4, rank=0, world_size=1, shuffle=False, seed=3)
    torch.manual_seed(0)
    engine = engine_of(torch.nn.Linear(2, 3), {**LOOP_CONFIG, "gradient_accumulation_steps": accumulation})
    engine.global_steps = at_step  # as a checkpoint load leaves it
    log, saves = runlog.RunLog(None, total), []
    log.write_row = log.rows.append  # keep the rows in memory: no output_dir
    stop = StopAt(stop_at, engine) if stop_at else None
    forward = TrainStep(engine, tasks.ImageClassification(Settings()), compile_model=False)
    fitted = loop.Loop(forward, train_loader, eval_loader, loop.Schedule(total, **intervals), log,
                       save=lambda *at: saves.append(list(at)), stop=stop,
                       early=EarlyStopping("eval_loss", 100, keep_best=True) if accumulation > 1 else None)
    result = fitted.run(start)
    return {"rows": log.rows, "saves": saves, "result": result}


def _fit_every_scenario(rank, world, report):
    from app.distributed import dist
    from app.distributed import launch
    launch.prepare_environment()
    launch.setup(timeout_s=120)
    try:
        report.write_text(json.dumps({name: _fit(*scenario) for name, scenario in SCENARIOS.items()}))
    finally:
        dist.teardown()


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """Each scenario's rows, saves and result, all fitted in one spawned rank with a real engine."""
    report = tmp_path_factory.mktemp("loop") / "report.json"
    spawn_ranks(1, _fit_every_scenario, report)
    return json.loads(report.read_text())


def _losses(rows):
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_loop_logs_evaluates_and_saves_where_the_schedule_says(fitted):
    rows, saves, result = (fitted["intervals"][k] for k in ("rows", "saves", "result"))
    assert [(r["step"], r["epoch"]) for r in rows if "loss" in r] == [(2, 0), (4, 1), (6, 1), (7, 2)]
    assert [(r["step"], r["epoch"]) for r in rows if "eval_loss" in r] == [(3, 0), (6, 1), (7, 2)], \
        "at each epoch's end, and at the last step"
    # a save at an epoch's last batch points at the start of the next epoch
    assert saves == [[3, 1, 0], [6, 2, 0], [7, 2, 1]]
    assert result["steps"] == 7 and result["samples"] == 4 + 4 + 2 + 4 + 4 + 2 + 4, "padding is not counted"
    assert result["stopped_early"] is False and result["eval_loss"] == rows[-1]["eval_loss"]
    assert all(r["lr"] == 0.0 and r["samples_per_s"] > 0 for r in rows if "loss" in r)


def test_loop_with_an_eval_interval_does_not_evaluate_at_epoch_ends(fitted):
    rows, saves = fitted["eval_interval"]["rows"], fitted["eval_interval"]["saves"]
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4, 6, 7]
    assert [r["step"] for r in rows if "loss" in r] == [7] and saves == [[7, 2, 1]]


def test_loop_resumed_mid_epoch_sees_the_batches_the_whole_run_saw(fitted):
    whole, resumed = _losses(fitted["whole"]["rows"]), _losses(fitted["resumed"]["rows"])
    assert list(resumed) == [6, 7]
    assert resumed == {step: whole[step] for step in resumed}
    assert fitted["resumed"]["saves"] == [[7, 2, 1]] and fitted["resumed"]["result"]["steps"] == 7


def test_loop_stops_when_every_rank_agrees_and_saves_where_it_stopped(fitted):
    rows, saves, result = (fitted["stopped"][k] for k in ("rows", "saves", "result"))
    assert [r["step"] for r in rows if "loss" in r] == [2]
    assert saves == [[2, 0, 2]] and result["stopped_early"] is True and result["steps"] == 2
    assert not [r for r in rows if "eval_loss" in r], "a stopped run saves and leaves; no evaluation"


def test_a_save_at_an_epoch_end_inside_a_window_resumes_at_the_windows_start(fitted):
    """The epoch ends one micro batch into step 2's window: the new best's checkpoint (step 1) resumes at that
    window's first batch, so the resumed run's steps take the whole run's windows."""
    whole, resumed = fitted["accumulated"], fitted["accumulated_resumed"]
    assert whole["saves"][0] == [1, 0, 2], "step 1, resuming at epoch 0's batch 2, the window's first"
    assert list(_losses(resumed["rows"])) == [2, 3, 4]
    assert _losses(resumed["rows"]) == {step: _losses(whole["rows"])[step] for step in (2, 3, 4)}
