"""A run that diverges stops: steps whose loss or gradient norm is not finite (skipped by the optimizer or not) are
counted on the device and read at log rows; too many in a row end the run in one line, and no checkpoint is ever
written from weights that are not finite (docs/checkpoints.md, "A run that diverges")."""
import torch

from app.distributed import dist
from app.ds import internals as ds_internals
from app.errors import UserError


class Divergence:
    """Per optimizer step, on the device: was it bad (a loss or gradient norm that is not finite, or a step DeepSpeed
    skipped), and how many bad steps in a row. On the host, at log rows and saves only: the verdict, agreed by every
    rank."""

    def __init__(self, engine, limit: int):
        """limit: bad steps in a row that end the run (0: never; saves still refuse weights that are not finite)."""
        self.engine, self.limit = engine, limit
        self.norms = ds_internals.bad_norms(engine)  # None: DeepSpeed's host check counts skipped steps itself
        device = engine.device
        self.streak = torch.zeros((), dtype=torch.int64, device=device)  # bad steps in a row, up to the last step
        self.since = torch.zeros((), dtype=torch.int64, device=device)  # the first step of that streak
        self.tripped = torch.full((), -1, dtype=torch.int64, device=device)  # `since` of a streak that hit limit
        self.counted = 0  # steps skipped on the device already handed to DeepSpeed's count and schedule

    def stepped(self, loss_not_finite: torch.Tensor):
        """After optimizer step engine.global_steps: loss_not_finite (a device bool) says whether any loss of its
        micro batches was not finite. A step fp16's dynamic loss scale skipped while above its minimum is its
        search for a scale, not a bad step."""
        skipped = not self.engine.was_step_applied() and not ds_internals.scale_searching(self.engine)
        bad = loss_not_finite | skipped
        if self.norms is not None:
            bad = bad | (self.norms.last > 0)
        self.streak = (self.streak + 1) * bad
        self.since = torch.where(self.streak == 1, self.engine.global_steps, self.since)
        if self.limit:
            self.tripped = torch.where((self.streak >= self.limit) & (self.tripped < 0), self.since, self.tripped)

    def check(self) -> int:
        """At a log row: end the run (one line) if a streak of bad steps reached the limit on any rank; hand the
        steps skipped on the device to DeepSpeed's count and learning-rate schedule; the run's skipped steps."""
        tripped, _, _ = self._read()
        if tripped >= 0:
            raise UserError(self._diverged(tripped, weights_finite=True))
        return self.engine.skipped_steps

    def before_save(self):
        """Before a checkpoint: what check() does, and end the run instead if any rank's weights are not finite,
        so that no checkpoint of such weights replaces a good one."""
        tripped, streak, since = self._read()
        finite = dist.host_max([0 if ds_internals.weights_finite(self.engine) else 1])[0] == 0
        if tripped >= 0 or not finite:
            raise UserError(self._diverged(tripped if tripped >= 0 else since if streak else 0, finite))

    def _read(self) -> tuple:
        """(tripped, streak, since), the largest of any rank; DeepSpeed told of newly skipped steps."""
        values = [self.tripped, self.streak, self.since] + ([self.norms.skipped] if self.norms is not None else [])
        read = torch.stack(values).tolist()  # one read, at a log row or a save
        tripped, streak, since, *skipped = dist.host_max(read)
        if skipped:
            ds_internals.count_skipped_steps(self.engine, int(skipped[0]) - self.counted)
            self.counted = int(skipped[0])
        return int(tripped), int(streak), int(since)

    def _diverged(self, since: int, weights_finite: bool) -> str:
        """The line that ends a diverged run: since when, that nothing was saved, what to try."""
        step = self.engine.global_steps
        when = f"since step {since}" if since > 0 else f"at step {step}"
        weights = "its weights are not finite; " if not weights_finite else ""
        fixes = "lower the learning rate (optimizer.params.lr in the ds_config) or lengthen its warm-up"
        if self.engine.bfloat16_enabled():
            fixes += ", or keep fp32 weights (torch_autocast in place of the \"bf16\" section)"
        return (f"the run diverged: its loss or gradient norm has not been finite {when} (now step {step}; "
                f"--max_nonfinite_steps {self.limit}); {weights}nothing was saved from these steps; {fixes}, then "
                f"run again with --resume auto (from the newest checkpoint, which holds finite weights, if any)")
