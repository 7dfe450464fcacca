"""The loop's schedule: when it logs, evaluates, saves and stops, and the run's length in optimizer steps; the
evaluation of several sources, each weighed by its loader's units.
Loop.run driving a real DeepSpeed engine: tests/e2e/test_loop.py."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from app.core import loop
from app.data import loader, sources
from app.data.samples import Samples
from app.errors import UserError

STEPS = range(1, 13)


def _steps(decide) -> list:
    return [step for step in STEPS if decide(step)]


def test_schedule_with_intervals():
    schedule = loop.Schedule(total_steps=10, log_interval=3, eval_interval=4, save_interval=5)
    assert _steps(lambda s: schedule.log_now(s, stopping=False)) == [3, 6, 9, 10, 11, 12]
    assert _steps(schedule.eval_now) == [4, 8, 10, 11, 12]
    assert _steps(schedule.eval_after_epoch) == [], "an eval interval replaces the evaluation at each epoch's end"
    assert _steps(lambda s: schedule.save_now(s, stopping=False)) == [5, 10, 11, 12]
    assert _steps(schedule.finished) == [10, 11, 12]


def test_schedule_defaults_evaluate_at_epoch_ends_and_save_at_the_end():
    schedule = loop.Schedule(total_steps=7)
    assert (schedule.log_interval, schedule.eval_interval, schedule.save_interval) == (10, 0, 0)
    assert _steps(lambda s: schedule.log_now(s, stopping=False)) == [7, 8, 9, 10, 11, 12]
    assert _steps(schedule.eval_now) == [7, 8, 9, 10, 11, 12]
    assert _steps(schedule.eval_after_epoch) == [1, 2, 3, 4, 5, 6], "the last step has evaluated already"
    assert _steps(lambda s: schedule.save_now(s, stopping=False)) == [7, 8, 9, 10, 11, 12]


def test_a_stopping_run_logs_and_saves_at_once():
    schedule = loop.Schedule(total_steps=100, log_interval=10, save_interval=50)
    assert schedule.log_now(13, stopping=True) and schedule.save_now(13, stopping=True)
    assert not schedule.log_now(13, stopping=False) and not schedule.save_now(13, stopping=False)
    assert not schedule.eval_now(13) and not schedule.finished(13), "stopping does not evaluate nor finish"


@pytest.mark.parametrize("max_steps, epochs, batches, accumulation, steps", [
    (0, 2, 23, 1, 46), (0, 2, 23, 2, 23), (0, 3, 5, 4, 3), (7, 10, 23, 1, 7), (100, 1, 5, 1, 100)])
def test_total_steps(max_steps, epochs, batches, accumulation, steps):
    assert loop.total_steps(max_steps, epochs, batches, accumulation) == steps


def test_a_run_too_short_for_one_optimizer_step_is_refused():
    with pytest.raises(UserError, match="1 epoch\\(s\\) of 3 micro batches make no optimizer step with "
                                        "gradient_accumulation_steps 4"):
        loop.total_steps(0, 1, 3, 4)


class Held(Samples):
    """Two sources' held-out rows: a's 2 of one unit each, b's 3 of two units each (answer tokens)."""
    units = [1.0, 1.0, 2.0, 2.0, 2.0]
    sources = sources.Sources(["a", "b"], [0, 2, 5], np.ones(5))

    def __len__(self):
        return 5

    def __getitem__(self, i):
        return torch.tensor([float(i)]), torch.tensor(i)


def test_the_evaluation_of_several_sources_weighs_each_by_the_units_its_loader_holds():
    """eval_loss is the mean over every unit held out: each source's weighed by its loader's units (2 and 6)."""
    loaders = loader.held_out_loaders(Held(), 2, rank=0, world_size=1, seed=0)
    losses = {"a": 1.0, "b": 3.0}
    by_loader = {id(made): losses[name] for name, made in loaders.items()}
    step = SimpleNamespace(evaluate=lambda made: {"eval_loss": by_loader[id(made)]},
                           task=SimpleNamespace(eval_metrics=lambda loss: {"eval_perplexity": math.exp(loss)}))
    result = loop.evaluate(step, loaders)
    assert result["eval_loss"] == pytest.approx((1.0 * 2 + 3.0 * 6) / 8)
    assert result["eval_perplexity"] == pytest.approx(math.exp(2.5)), "derived from the combined loss"
    assert (result["eval_loss/a"], result["eval_loss/b"]) == (1.0, 3.0)
