"""The training step: one micro batch forward, backward and (at the end of an accumulation window) the optimizer
step through the DeepSpeed engine, and evaluation; compiled through app/core/compiling.py when asked."""
import torch

from app.core import compiling
from app.core.fused_loss import next_token_targets
from app.ds.precision import input_dtype
from app.observe.metrics import Meter


def forward(engine, loss, inputs: list, labels: torch.Tensor) -> tuple:
    """(logits, per-sample losses) of one micro batch."""
    logits = engine(*inputs)
    return logits, loss(logits, labels)


class TrainStep:
    """What the loop runs: micro_step for each micro batch of training, evaluate for the held-out set."""

    def __init__(self, engine, task, compile_model: bool, board=None):
        """board: the run's endings.Board, where the ranks agree on the first compiled step (one of their own when
        None)."""
        self.engine, self.task, self.dtype = engine, task, input_dtype(engine)
        self.compiler = compiling.Compiled(engine, task, forward, board) if compile_model else None

    @property
    def compiled(self) -> bool:
        """Whether the step runs compiled: False when not asked, or once every rank fell back to eager."""
        return self.compiler is not None and self.compiler.compiled

    def logits_and_losses(self, inputs: list, labels: torch.Tensor) -> tuple:
        """(logits, per-sample losses) of one micro batch, compiled or eager."""
        if self.compiler is not None:
            return self.compiler(inputs, labels)
        return forward(self.engine, self.task.loss, inputs, labels)

    metrics = ["loss"]
    """What the meter sums at each micro step, and the log rows show."""

    def batch_loss(self, batch) -> tuple:
        """(the micro batch's weighted loss, its sums for the meter, its weights): the weights
        (app/data/loader.py) make the step's loss the mean over every sample, or answer token, of the window on
        every rank, however it is split."""
        x, y, w = to_device(batch, self.engine.device, self.dtype)
        _, losses = self.logits_and_losses(self.with_targets(x, y), y)
        return (losses * w).sum(), {"loss": (losses.detach() * w).sum()}, w

    def micro_step(self, batch, meter: Meter):
        """One micro batch: forward, engine.backward(loss), engine.step() (an optimizer step once the
        accumulation window is full)."""
        loss, sums, w = self.batch_loss(batch)
        self.engine.backward(loss)
        self.engine.step()
        w = self.meter_weights(w)
        meter.add((w > 0).sum(), w.sum(), **sums)

    def with_targets(self, inputs: list, labels: torch.Tensor) -> list:
        """The model's inputs, and the next-token targets where the task fuses the output layer with its loss."""
        if not self.task.fused_logits:
            return inputs
        return [inputs[0], inputs[1] if len(inputs) > 1 else None, next_token_targets(labels)]

    def correct(self, logits, labels: torch.Tensor) -> torch.Tensor:
        """Each sample's accuracy in an evaluation, 0.0 to 1.0 (the task's)."""
        return self.task.correct(logits, labels)

    def meter_weights(self, weights: torch.Tensor) -> torch.Tensor:
        """The weights of a micro batch's samples in the meters, which count each sample once over all ranks: all
        of them here."""
        return weights

    def trial_parts(self, batch) -> list:
        """The micro batch search's step in parts the ranks agree on one at a time: the forward (a rank out of
        memory there stops before any gradient is reduced), then the backward and the optimizer step."""
        held = {}
        return [lambda: held.update(loss=self.batch_loss(batch)[0]),
                lambda: (self.engine.backward(held.pop("loss")), self.engine.step())]

    def evaluate(self, loader) -> dict:
        """Eval loss and accuracy (and the task's own extras) over every rank's shard, padding excluded: means over
        samples, or answer tokens (the loader's weights count them)."""
        engine, task = self.engine, self.task
        meter = Meter(["loss", "accuracy"], engine.device, engine.autotp_size())
        engine.eval()
        with torch.no_grad():
            for batch in loader:
                x, y, w = to_device(batch, engine.device, self.dtype)
                logits, losses = self.logits_and_losses(self.with_targets(x, y), y)
                counted = self.meter_weights(w)
                meter.add((counted > 0).sum(), counted.sum(), loss=(losses * w).sum(),
                          accuracy=(self.correct(logits, y) * w).sum())
        engine.train()
        result = meter.reduce()
        return {"eval_loss": result["loss"], "eval_accuracy": result["accuracy"],
                **task.eval_metrics(result["loss"])}


def to_device(batch, device, dtype):
    """(model inputs as a list, labels, weights) on the device; floating inputs in the engine's dtype."""
    x, y, w = batch
    inputs = [t.to(device, non_blocking=True) for t in (x if isinstance(x, (list, tuple)) else [x])]
    inputs = [t.to(dtype) if t.is_floating_point() else t for t in inputs]
    return inputs, y.to(device, non_blocking=True), w.to(device, non_blocking=True)
