"""The forward pass a loop runs (micro step and evaluation), with torch.compile through the DeepSpeed engine
(model and loss), and TF32 for fp32 CUDA runs."""
import torch

from app import dist, ds_internals
from app.metrics import Meter


def wanted(choice: str, device: torch.device) -> bool:
    """--compile on/off, or auto: on for CUDA devices only (on CPU the compile time is not won back)."""
    return choice == "on" or (choice == "auto" and device.type == "cuda")


def set_tf32(device: torch.device, dtype: torch.dtype, choice: str) -> str:
    """Let fp32 CUDA matmuls and convolutions use TF32 (unless --tf32 off); a note for the mode line."""
    if device.type != "cuda" or dtype != torch.float32:
        return ""
    on = choice == "on"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = on
    return "TF32 matmuls" if on else "full-fp32 matmuls (--tf32 off)"


def input_dtype(engine) -> torch.dtype:
    """The dtype the engine's parameters are kept in for the forward pass."""
    if engine.bfloat16_enabled():
        return torch.bfloat16
    if engine.fp16_enabled():
        return torch.float16
    return torch.float32


class Forward:
    """The forward pass and the task's per-sample loss a loop runs: eager, or compiled once with fixed shapes.

    Every micro batch has the same shape (the sampler pads the last one with weight-0 samples), so
    each mode compiles one graph: one for training, one for evaluation (no_grad). If compiling fails
    the first time a mode runs, it says so in one line and that run continues eager.
    """

    def __init__(self, engine, task, compile_model: bool):
        self.engine, self.task, self.loss = engine, task, task.loss
        self.dtype = input_dtype(engine)
        self.proven = set()  # modes (training or not) whose compiled graph has run once
        self.compiled = False
        if compile_model:
            dist.print0(f"compile: compiling the model and its loss with torch.compile (inductor, fixed shapes) "
                        f"on {engine.device.type}; the first training and evaluation steps take longer")
            engine.compile(backend="inductor", compile_kwargs={"dynamic": False})
            ds_internals.engine_hooks_eager(engine)
            self.loss = torch.compile(task.loss, backend="inductor", dynamic=False)
            self.compiled = True

    def logits_and_losses(self, inputs: list, labels: torch.Tensor) -> tuple:
        """(logits, per-sample losses) of one micro batch."""
        mode = self.engine.training
        if not self.compiled or mode in self.proven:
            return self._run(inputs, labels)
        try:
            result = self._run(inputs, labels)
        except Exception as e:  # noqa: BLE001 (any compiler failure; a model bug reappears eager below)
            line = next((s for s in str(e).splitlines() if s.strip()), type(e).__name__)
            dist.print0(f"compile: ZeRO stage {self.engine.zero_optimization_stage()} could not be compiled "
                        f"({type(e).__name__}: {line[:200]}); running eager")
            self.eager()
            return self._run(inputs, labels)
        self.proven.add(mode)
        return result

    def micro_step(self, batch, meter: Meter):
        """One micro batch: forward, engine.backward(loss), engine.step() (an optimizer step once the
        accumulation window is full); the loss is weighted so ranks average exactly."""
        x, y, w = _to_device(batch, self.engine.device, self.dtype)
        _, losses = self.logits_and_losses(x, y)
        self.engine.backward((losses * w).sum())
        self.engine.step()
        real = (w > 0).to(losses.dtype)
        meter.add(real.sum(), loss=(losses.detach() * real).sum())

    def evaluate(self, loader) -> dict:
        """Eval loss and accuracy (and the task's own extras) over every rank's shard, padding excluded."""
        engine, task = self.engine, self.task
        meter = Meter(["loss", "accuracy"], engine.device)
        engine.eval()
        with torch.no_grad():
            for batch in loader:
                x, y, w = _to_device(batch, engine.device, self.dtype)
                logits, losses = self.logits_and_losses(x, y)
                real = (w > 0).float()
                meter.add(real.sum(), loss=(losses * real).sum(), accuracy=(task.correct(logits, y) * real).sum())
        engine.train()
        result = meter.reduce()
        return {"eval_loss": result["loss"], "eval_accuracy": result["accuracy"],
                **task.eval_metrics(result["loss"])}

    def _run(self, inputs, labels):
        logits = self.engine(*inputs)
        return logits, self.loss(logits, labels)

    def eager(self):
        """Undo compilation: the module's plain forward and the plain loss from now on."""
        ds_internals.uncompile(self.engine)
        self.loss, self.compiled = self.task.loss, False


def _to_device(batch, device, dtype):
    """(model inputs as a list, labels, weights) on the device; floating inputs in the engine's dtype."""
    x, y, w = batch
    inputs = [t.to(device, non_blocking=True) for t in (x if isinstance(x, (list, tuple)) else [x])]
    inputs = [t.to(dtype) if t.is_floating_point() else t for t in inputs]
    return inputs, y.to(device, non_blocking=True), w.to(device, non_blocking=True)
