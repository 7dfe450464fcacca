"""The forward pass a loop runs (micro step and evaluation), with torch.compile through the DeepSpeed engine
(model and loss), and TF32 for fp32 CUDA runs."""
import time

import torch

from app.ds.internals import torch_private
from app.distributed import dist
from app.ds import internals as ds_internals
from app.distributed import faults
from app.errors import UserError, first_line
from app.observe.metrics import MEMORY_ADVICE, Meter, out_of_memory


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


def compute_dtype(engine) -> torch.dtype:
    """The dtype the model's matmuls run in: torch_autocast's, else the weights' own."""
    if engine.torch_autocast_enabled():
        return engine.torch_autocast_dtype() or torch.bfloat16
    return input_dtype(engine)


def precision_name(engine) -> str:
    """'bf16 autocast' (fp32 weights), 'bf16' or 'fp16' (16-bit weights), or 'fp32'."""
    short = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[compute_dtype(engine)]
    return f"{short} autocast" if engine.torch_autocast_enabled() else short


class Forward:
    """The forward pass and the task's per-sample loss a loop runs: eager, or compiled once with fixed shapes.

    Every micro batch has the same shape (the sampler pads the last one with weight-0 samples), so
    each mode compiles one graph: one for training, one for evaluation (no_grad). The first compiled
    forward of a mode compiles its backward too, and every rank then says how it went: if any rank
    could not compile, rank 0 names it in one line and every rank runs eager; any other error (out
    of memory, a collective, the model itself) ends the run in one line naming the rank, also when the
    others went on into a collective of the step and cannot come to agree (dist.gather_outcomes).
    """

    def __init__(self, engine, task, compile_model: bool):
        self.engine, self.task, self.loss = engine, task, task.loss
        self.dtype = input_dtype(engine)
        self.proven = set()  # modes (training or not) whose compiled graph has run once
        self.compiled = False
        if compile_model:
            dist.print0(f"compile: compiling the model and its loss with torch.compile (inductor, fixed shapes) "
                        f"on {engine.device.type}; the first training and evaluation steps take longer")
            backend = faults.compile_backend()
            engine.compile(backend=backend, compile_kwargs={"dynamic": False})
            ds_internals.engine_hooks_eager(engine)
            self.loss = torch.compile(task.loss, backend=backend, dynamic=False)
            self.compiled = True

    def logits_and_losses(self, inputs: list, labels: torch.Tensor) -> tuple:
        """(logits, per-sample losses) of one micro batch."""
        if not self.compiled or self.engine.training in self.proven:
            return self._run(inputs, labels)
        return self._first_compiled(inputs, labels)

    def _first_compiled(self, inputs: list, labels: torch.Tensor) -> tuple:
        """The first compiled forward of a mode, its backward compiled with it (before any gradient
        collective), then every rank's outcome agreed on the host group."""
        mode, result, failure, started = self.engine.training, None, None, time.perf_counter()
        try:
            with torch_private.compile_backward_with_forward():
                result = self._run(inputs, labels)
        except Exception as e:  # noqa: BLE001 (sorted below: a compiler failure, or the run's end)
            failure = e
        step = "training" if mode else "evaluation"
        mine = _outcome(failure)
        # the others may still be compiling, which takes minutes on a large model: a longer patience
        outcomes = dist.gather_outcomes(mine, time.perf_counter() - started if failure else None, patience_s=300)
        if outcomes is None:  # the others went on into a collective of this step (ZeRO-3's gathers) and wait there
            raise dist.leave(f"the first {step} step failed on rank {dist.rank()}: {mine[1]}; the "
                             f"other ranks went on into that step's collectives")
        fatal = [(rank, text) for rank, (kind, text) in enumerate(outcomes) if kind == "fatal"]
        if fatal:
            rank, text = fatal[0]
            raise UserError(f"the first {step} step failed on rank {rank}: {text}") from None
        refused = [(rank, text) for rank, (kind, text) in enumerate(outcomes) if kind == "compile"]
        if refused:
            ranks = ",".join(str(rank) for rank, _ in refused)
            dist.print0(f"compile: ZeRO stage {self.engine.zero_optimization_stage()} could not be compiled on "
                        f"rank {ranks} ({refused[0][1]}); every rank runs eager")
            self.eager()  # every rank redoes this step eager: ZeRO 1-2 reduce gradients in the order they come,
            return self._eager_retry(inputs, labels, step)  # and a compiled backward brings them in another
        self.proven.add(mode)
        return result

    def _eager_retry(self, inputs: list, labels: torch.Tensor, step: str) -> tuple:
        """This micro batch again, eager; an error now is the model's own."""
        try:
            return self._run(inputs, labels)
        except Exception as e:  # noqa: BLE001 (one line, not a traceback of the compiler's attempt)
            raise UserError(f"the first {step} step failed on rank {dist.rank()}: {describe(e)}") from None

    def micro_step(self, batch, meter: Meter):
        """One micro batch: forward, engine.backward(loss), engine.step() (an optimizer step once the
        accumulation window is full); the loss is weighted so ranks average exactly."""
        x, y, w = to_device(batch, self.engine.device, self.dtype)
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
                x, y, w = to_device(batch, engine.device, self.dtype)
                logits, losses = self.logits_and_losses(x, y)
                real = (w > 0).float()
                meter.add(real.sum(), loss=(losses * real).sum(), accuracy=(task.correct(logits, y) * real).sum())
        engine.train()
        result = meter.reduce()
        return {"eval_loss": result["loss"], "eval_accuracy": result["accuracy"],
                **task.eval_metrics(result["loss"])}

    def _run(self, inputs, labels):
        faults.out_of_memory_at(len(labels))
        logits = self.engine(*inputs)
        faults.out_of_memory_at(len(labels), logits)
        return logits, self.loss(logits, labels)

    def eager(self):
        """Undo compilation: the module's plain forward and the plain loss from now on."""
        ds_internals.uncompile(self.engine)
        self.loss, self.compiled = self.task.loss, False


def _chain(error: BaseException) -> list:
    """error and every exception it was raised from or during."""
    chain = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__ or getattr(error, "inner_exception", None)
    return chain


def describe(error: BaseException) -> str:
    """'Type: first line' of the innermost exception that says what went wrong."""
    inner = _chain(error)[-1]
    return f"{type(inner).__name__}: {first_line(inner)[:300]}"


def _outcome(error) -> tuple:
    """('', '') when the compiled step ran; ('compile', why) when the compiler failed; ('fatal', why) for an
    error that running eager would not cure: out of memory, a collective, anything outside the compiler."""
    if error is None:
        return "", ""
    chain = _chain(error)
    if any(out_of_memory(e) for e in chain):
        return "fatal", f"out of memory ({describe(error)}); {MEMORY_ADVICE}"
    if any(isinstance(e, torch.distributed.DistError) for e in chain) or not torch_private.is_dynamo_error(error):
        return "fatal", describe(error)
    return "compile", describe(error)


def to_device(batch, device, dtype):
    """(model inputs as a list, labels, weights) on the device; floating inputs in the engine's dtype."""
    x, y, w = batch
    inputs = [t.to(device, non_blocking=True) for t in (x if isinstance(x, (list, tuple)) else [x])]
    inputs = [t.to(dtype) if t.is_floating_point() else t for t in inputs]
    return inputs, y.to(device, non_blocking=True), w.to(device, non_blocking=True)
