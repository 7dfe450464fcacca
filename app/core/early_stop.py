"""Early stopping and the best checkpoint: the evaluation a run watches, its best value so far, and how many
evaluations in a row have not beaten it (docs/watching.md, "Early stopping")."""
import math
from dataclasses import asdict, dataclass

from app.distributed import dist
from app.errors import UserError

LOWER_IS_BETTER = ("loss", "perplexity")


def watched(metric: str) -> tuple:
    """(name, 'min' or 'max') of --early_stopping_metric NAME[:min|:max]; without a direction, min for a loss or
    perplexity and max for anything else (an accuracy, a reward), judged by the name before any /<source> (a
    source or a reward may be called anything)."""
    name, _, mode = metric.partition(":")
    if not name.startswith("eval_") or mode not in ("", "min", "max"):
        raise UserError(f"--early_stopping_metric {metric!r}: give an evaluation's name, optionally with its "
                        f"direction, as NAME, NAME:min or NAME:max (for example eval_loss or "
                        f"eval_reward_accuracy:max)")
    kind = name.split("/")[0]
    return name, mode or ("min" if any(word in kind for word in LOWER_IS_BETTER) else "max")


@dataclass
class Record:
    """What a checkpoint keeps of early stopping, so that a resumed run continues the count."""
    metric: str
    mode: str
    best: float | None = None
    best_step: int = 0
    bad: int = 0
    """Evaluations in a row since the best that did not beat it."""


class EarlyStopping:
    """Watches one evaluation: after each, whether it is the best so far and whether the run should stop."""

    def __init__(self, metric: str, patience: int, keep_best: bool = False, saved: dict = None):
        """metric: --early_stopping_metric; patience: evaluations without improvement that stop the run (0:
        never); keep_best: each new best is saved and kept (--keep_best); saved: a resumed checkpoint's record,
        continued when it watched the same metric the same way."""
        name, mode = watched(metric)
        self.patience, self.keep_best = patience, keep_best
        self.state = Record(name, mode)
        if saved and (saved.get("metric"), saved.get("mode")) == (name, mode):
            self.state = Record(**saved)

    def update(self, step: int, evaluation: dict) -> bool:
        """After the evaluation of optimizer step `step`: True when it is the best so far. The value judged is rank
        0's, sent to every rank, so that all agree on the best and on the step to stop at."""
        state = self.state
        if state.metric not in evaluation:
            held = ", ".join(sorted(evaluation))
            raise UserError(f"--early_stopping_metric {state.metric}: the evaluation gives {held}; pick one of them")
        value = float(dist.broadcast_object(repr(float(evaluation[state.metric]))))  # as text: nan and inf too
        better = math.isfinite(value) and (state.best is None or
                                           (value < state.best if state.mode == "min" else value > state.best))
        if better:
            state.best, state.best_step, state.bad = value, step, 0
        else:
            state.bad += 1
        return better

    def stop(self) -> bool:
        """True once patience evaluations in a row have not beaten the best."""
        return bool(self.patience) and self.state.bad >= self.patience

    def record(self) -> dict:
        return asdict(self.state)

    def kept_step(self) -> int:
        """The step whose checkpoint --keep_best keeps besides the newest (0: none)."""
        return self.state.best_step if self.keep_best else 0

    def ended_before(self) -> bool:
        """True (and says so) when the resumed checkpoint's run had already stopped early."""
        if not self.stop():
            return False
        dist.print0(f"nothing to do: this run stopped early, {self.why()}; raise --early_stopping_patience or set "
                    f"it to 0 to train further")
        return True

    def why(self) -> str:
        """The reason a stopped run gives."""
        state = self.state
        best = "no finite value yet" if state.best is None else f"best {state.best:.6g} at step {state.best_step}"
        return f"{state.metric} has not improved for {state.bad} evaluation(s) ({best})"  # None: NaN or empty counts


def for_run(settings, saved, task) -> EarlyStopping | None:
    """The run's EarlyStopping (None when neither --early_stopping_patience nor --keep_best is set), continuing
    the count of the resumed checkpoint's state (saved; None for a fresh run); without --early_stopping_metric it
    watches the task's first summary metric (eval_loss; GRPO's eval_reward)."""
    if not (settings.early_stopping_patience or settings.keep_best):
        return None
    return EarlyStopping(settings.early_stopping_metric or task.summary_metrics[0], settings.early_stopping_patience,
                         settings.keep_best, saved.early_stopping if saved is not None else None)
