"""torch.compile through the DeepSpeed engine (model and loss), and TF32 for fp32 CUDA runs."""
import torch

from app import distributed
from app.models import per_sample_loss


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


def _engine_hooks_eager(engine):
    """Run the engine's own forward hooks outside the compiled graph.

    They read DeepSpeed's step counters (micro_steps, ...), on which a traced hook would guard, so the
    model would recompile at every step until torch's recompile limit turns compilation off. ZeRO-3's
    parameter hooks on the submodules stay traced: DeepSpeed writes those for torch.compile.
    """
    module = engine.module
    for hooks, handle in ((module._forward_pre_hooks, engine.module_forward_pre_hook),
                          (module._forward_hooks, engine.module_forward_post_hook)):
        hooks[handle.id] = torch.compiler.disable(hooks[handle.id])


class Step:
    """The forward and loss a loop runs: eager, or compiled once with fixed shapes.

    Every micro batch has the same shape (the sampler pads the last one with weight-0 samples), so
    each mode compiles one graph: one for training, one for evaluation (no_grad). If compiling fails
    the first time a mode runs, it says so in one line and that run continues eager.
    """

    def __init__(self, engine, compile_model: bool):
        self.engine, self.loss = engine, per_sample_loss
        self.proven = set()  # modes (training or not) whose compiled graph has run once
        self.compiled = False
        if compile_model:
            distributed.print0(f"compile: compiling the model and its loss with torch.compile (inductor, fixed shapes) "
                               f"on {engine.device.type}; the first training and evaluation steps take longer")
            engine.compile(backend="inductor", compile_kwargs={"dynamic": False})
            _engine_hooks_eager(engine)
            self.loss = torch.compile(per_sample_loss, backend="inductor", dynamic=False)
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
            distributed.print0(f"compile: ZeRO stage {self.engine.zero_optimization_stage()} could not be compiled "
                               f"({type(e).__name__}: {line[:200]}); running eager")
            self.eager()
            return self._run(inputs, labels)
        self.proven.add(mode)
        return result

    def _run(self, inputs, labels):
        logits = self.engine(*inputs)
        return logits, self.loss(logits, labels)

    def eager(self):
        """Undo compilation: the module's plain forward and the plain loss from now on."""
        self.engine.module._compiled_call_impl = None
        self.engine._is_compiled = False
        self.loss, self.compiled = per_sample_loss, False
