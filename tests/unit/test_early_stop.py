"""Early stopping: the watched evaluation and its direction, the count of evaluations without improvement, and the
record a checkpoint keeps so that a resumed run continues it. A real run that stops early, keeps its best
checkpoint and resumes from it: tests/e2e/test_early_stop.py."""
from types import SimpleNamespace

import pytest

from app.core import early_stop
from app.core.early_stop import EarlyStopping
from app.errors import UserError


@pytest.mark.parametrize("metric, watched", [
    ("eval_loss", ("eval_loss", "min")), ("eval_perplexity", ("eval_perplexity", "min")),
    ("eval_loss/wiki", ("eval_loss/wiki", "min")), ("eval_accuracy", ("eval_accuracy", "max")),
    ("eval_reward_accuracy", ("eval_reward_accuracy", "max")), ("eval_reward", ("eval_reward", "max")),
    ("eval_loss:max", ("eval_loss", "max")), ("eval_accuracy:min", ("eval_accuracy", "min")),
    ("eval_accuracy/glossary", ("eval_accuracy/glossary", "max")),  # a source's name does not turn it round
    ("eval_rewards/length_loss/mean", ("eval_rewards/length_loss/mean", "max"))])
def test_the_direction_is_min_for_a_loss_or_perplexity_else_max_unless_given(metric, watched):
    assert early_stop.watched(metric) == watched


@pytest.mark.parametrize("metric", ["loss", "eval_loss:down", "accuracy:max", ""])
def test_a_metric_that_is_no_evaluation_or_a_direction_that_is_none_is_one_line(metric):
    with pytest.raises(UserError, match="give an evaluation's name, optionally with its direction"):
        early_stop.watched(metric)


def _judge(early: EarlyStopping, values, start=10, every=10) -> list:
    """Each value evaluated at steps start, start + every, ...: [(best?, stop?)]."""
    return [(early.update(start + every * i, {early.state.metric: v, "eval_other": 0.0}), early.stop())
            for i, v in enumerate(values)]


def test_the_run_stops_after_patience_evaluations_without_improvement():
    early = EarlyStopping("eval_loss", patience=2)
    assert _judge(early, [3.0, 2.0, 2.5, 2.0, 1.9, 2.1, 1.9]) == [
        (True, False), (True, False), (False, False), (False, True), (True, False), (False, False), (False, True)], \
        "equal to the best is no improvement; a new best resets the count"
    assert early.record() == {"metric": "eval_loss", "mode": "min", "best": 1.9, "best_step": 50, "bad": 2}
    assert early.why() == "eval_loss has not improved for 2 evaluation(s) (best 1.9 at step 50)"


def test_higher_is_better_for_an_accuracy_and_a_value_that_is_not_finite_never_improves():
    early = EarlyStopping("eval_accuracy", patience=3)
    assert [best for best, _ in _judge(early, [float("nan"), 0.5, 0.4, 0.6, float("inf"), float("nan")])] == [
        False, True, False, True, False, False]
    assert (early.state.best, early.state.best_step, early.state.bad, early.stop()) == (0.6, 40, 2, False)


def test_a_run_whose_evaluations_were_never_finite_says_so_when_it_stops(capsys):
    """Patience runs out before any finite value (an fp16 overflow, a held-out count of 0): the line, no traceback."""
    early = EarlyStopping("eval_loss", patience=1)
    assert _judge(early, [float("nan")]) == [(False, True)]
    assert early.why() == "eval_loss has not improved for 1 evaluation(s) (no finite value yet)"
    assert early.ended_before() and "nothing to do: this run stopped early" in capsys.readouterr().out


def test_patience_0_never_stops_but_keep_best_still_tracks_the_best_step():
    early = EarlyStopping("eval_loss", patience=0, keep_best=True)
    assert not any(stop for _, stop in _judge(early, [1.0] + [2.0] * 20))
    assert early.kept_step() == 10
    assert EarlyStopping("eval_loss", patience=3).kept_step() == 0, "without --keep_best no checkpoint is kept"


def test_a_resumed_run_continues_the_count_of_the_same_metric_and_restarts_another():
    first = EarlyStopping("eval_loss", patience=3)
    _judge(first, [2.0, 1.0, 1.5, 1.6])
    resumed = EarlyStopping("eval_loss", patience=3, saved=first.record())
    assert _judge(resumed, [1.2], start=50) == [(False, True)], "the third evaluation without improvement stops"
    other = EarlyStopping("eval_accuracy", patience=3, saved=first.record())
    assert other.record() == {"metric": "eval_accuracy", "mode": "max", "best": None, "best_step": 0, "bad": 0}
    flipped = EarlyStopping("eval_loss:max", patience=3, saved=first.record())
    assert flipped.state.best is None, "the other direction starts afresh"


def test_a_metric_the_evaluation_lacks_is_one_line_naming_what_it_has():
    early = EarlyStopping("eval_reward_accuracy", patience=1)
    with pytest.raises(UserError, match="--early_stopping_metric eval_reward_accuracy: the evaluation gives "
                                        "eval_accuracy, eval_loss, eval_loss/wiki; pick one of them"):
        early.update(10, {"eval_loss": 1.0, "eval_accuracy": 0.5, "eval_loss/wiki": 1.0})


def test_a_resumed_run_that_had_already_stopped_has_nothing_to_do(capsys):
    early = EarlyStopping("eval_loss", patience=1)
    _judge(early, [1.0, 1.1])
    assert EarlyStopping("eval_loss", patience=1, saved=early.record()).ended_before()
    assert "nothing to do: this run stopped early, eval_loss has not improved for 1" in capsys.readouterr().out
    assert not EarlyStopping("eval_loss", patience=2, saved=early.record()).ended_before(), \
        "a larger patience trains on"


def test_the_run_has_none_unless_patience_or_keep_best_is_set():
    settings = SimpleNamespace(early_stopping_patience=0, keep_best=False, early_stopping_metric="eval_loss")
    task = SimpleNamespace(summary_metrics=("eval_reward",))
    assert early_stop.for_run(settings, None, task) is None
    saved = SimpleNamespace(early_stopping={"metric": "eval_loss", "mode": "min", "best": 1.0, "best_step": 20,
                                            "bad": 1})
    settings.keep_best = True
    early = early_stop.for_run(settings, saved, task)
    assert (early.kept_step(), early.state.bad, early.stop()) == (20, 1, False)


def test_without_a_metric_the_run_watches_its_tasks_own():
    """GRPO's evaluation gives no eval_loss: its default is the mean reward, the most the better."""
    from app.core.grpo import Grpo
    from app.core.tasks import CausalLM
    settings = SimpleNamespace(early_stopping_patience=2, keep_best=False, early_stopping_metric="")
    assert early_stop.for_run(settings, None, Grpo).state.metric == "eval_reward"
    assert early_stop.for_run(settings, None, Grpo).state.mode == "max"
    assert early_stop.for_run(settings, None, CausalLM).state.metric == "eval_loss"
