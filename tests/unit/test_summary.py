"""The run's last line (app/observe/summary.py): the task's own metrics, then the rates, those the run has."""
from app.observe import summary


def test_the_last_line_shows_the_tasks_metrics_then_the_rates_it_has():
    values = {"eval_loss": 1.23456, "eval_reward_accuracy": 0.75, "eval_accuracy": 0.5, "samples_per_s": 12.0,
              "mfu": 0.31}
    assert summary.shown(values, ("eval_loss", "eval_reward_accuracy")) == \
        "eval_loss 1.235 eval_reward_accuracy 0.75 samples_per_s 12 mfu 0.31"
    assert summary.shown(values, ("eval_loss", "eval_accuracy", "eval_perplexity")) == \
        "eval_loss 1.235 eval_accuracy 0.5 samples_per_s 12 mfu 0.31", "a metric the run lacks is left out"
