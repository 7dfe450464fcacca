"""torch.compile of the model and its loss through the DeepSpeed engine, and the agreement of every rank on the
first compiled run of each mode: all compiled, or all eager, or the run's end in one line.

Every micro batch has the same shape (the sampler pads the last one with weight-0 samples), so each mode compiles
one graph: one for training, one for evaluation (no_grad). The first compiled forward of a mode compiles its
backward too, and every rank then says how it went: if any rank could not compile, rank 0 names it in one line
and every rank runs eager; any other error (out of memory, a collective, the model itself) ends the run in one
line naming the rank, also when the others went on into a collective of the step and cannot come to agree.
"""
import time

import torch

from app.distributed import dist, endings
from app.ds import internals as ds_internals
from app.ds.internals import torch_private
from app.errors import UserError, first_line


def wanted(choice: str, device: torch.device, eager_because: str = "", deepcompile: bool = False) -> bool:
    """--compile on/off, or auto: on for CUDA devices only (on CPU the compile time is not won back). eager_because:
    why this run must not compile ('' where it may): auto then trains eager and says why, on is refused.
    deepcompile: the engine's config asks for DeepSpeed's DeepCompile, which only a compiled run runs: an eager run
    says it trains without."""
    if eager_because and choice == "on":
        raise UserError(f"--compile on: {eager_because}; pass --compile off (or auto, which trains eager here)")
    if eager_because and choice == "auto" and device.type == "cuda":
        dist.print0(f"compile: off, eager: {eager_because}")
        compiled = False
    else:
        compiled = choice == "on" or (choice == "auto" and device.type == "cuda")
    if deepcompile and not compiled:
        dist.print0(f"compile: eager (--compile {choice}), so the DeepSpeed config's \"deepcompile\": true does "
                    f"nothing: DeepSpeed's DeepCompile runs in compiled runs only (--compile on)")
    return compiled


def allow_a_graph_per_block(module) -> int:
    """Let torch.compile keep a graph of each ZeRO-3 leaf block of module for training and one for evaluation,
    where its guards tell the blocks apart: torch 2.11 guards a block's graph on the ids DeepSpeed gives its
    weights (read by the backward of DeepSpeed's linear), and its limit of 8 graphs a function left the blocks past
    the eighth eager (8 of llama-1b's 16 on an H200). The limit now in force; 0 where module has no leaf blocks."""
    from deepspeed.utils import get_z3_leaf_modules
    blocks = len(get_z3_leaf_modules(module))
    return torch_private.allow_recompiles(2 * blocks + 8) if blocks else 0


class Compiled:
    """forward(engine, loss, inputs, labels) compiled: calling it runs the compiled model and loss, the first time
    in each mode agreed by every rank, and eager from then on if any rank could not compile."""

    def __init__(self, engine, task, forward, board=None):
        self.engine, self.task, self.forward = engine, task, forward
        self.board = board or endings.Board()
        self.proven = set()  # modes (training or not) whose compiled graph has run once
        dist.print0(f"compile: compiling the model and its loss with torch.compile (inductor, fixed shapes) "
                    f"on {engine.device.type}; the first training and evaluation steps take longer")
        allow_a_graph_per_block(engine.module)
        engine.compile(backend="inductor", compile_kwargs={"dynamic": False})
        ds_internals.engine_hooks_eager(engine)
        self.loss = torch.compile(task.loss, backend="inductor", dynamic=False)
        self.compiled = True

    def __call__(self, inputs: list, labels: torch.Tensor) -> tuple:
        if not self.compiled or self.engine.training in self.proven:
            return self.forward(self.engine, self.loss, inputs, labels)
        return self._first_compiled(inputs, labels)

    def _first_compiled(self, inputs: list, labels: torch.Tensor) -> tuple:
        """The first compiled forward of a mode, its backward compiled with it (before any gradient
        collective), then every rank's outcome agreed on the host group."""
        mode, result, failure, started = self.engine.training, None, None, time.perf_counter()
        try:
            with torch_private.compile_backward_with_forward():
                result = self.forward(self.engine, self.loss, inputs, labels)
        except Exception as e:  # noqa: BLE001 (sorted below: a compiler failure, or the run's end)
            failure = e
        step = "training" if mode else "evaluation"
        mine = _outcome(failure)
        # the others may still be compiling, which takes minutes on a large model: a longer patience
        outcomes = self.board.outcomes(mine, time.perf_counter() - started if failure else None, patience_s=300)
        if outcomes is None:  # the others went on into a collective of this step (ZeRO-3's gathers) and wait there
            raise self.board.alone(f"the first {step} step failed on rank {dist.rank()}: {mine[1]}; the "
                                   f"other ranks went on into that step's collectives")
        fatal = [(rank, text) for rank, (kind, text) in enumerate(outcomes) if kind == "fatal"]
        if fatal:
            rank, text = fatal[0]
            raise UserError(f"the first {step} step failed on rank {rank}: {text}") from None
        refused = [(rank, text) for rank, (kind, text) in enumerate(outcomes) if kind == "compile"]
        if refused:
            return self._refused(refused, inputs, labels, step)
        self.proven.add(mode)
        return result

    def _refused(self, refused: list, inputs: list, labels: torch.Tensor, step: str) -> tuple:
        """Every rank's answer to a first compiled step some rank's compiler refused: this step again eager, and
        eager from now on; one line where DeepSpeed's DeepCompile compiled it (its set-up took ZeRO's own gradient
        and gather hooks off for good: no eager step is left)."""
        ranks, stage = ",".join(str(rank) for rank, _ in refused), self.engine.zero_optimization_stage()
        if ds_internals.deepcompile_active(self.engine):
            raise UserError(f"DeepSpeed's DeepCompile could not compile ZeRO stage {stage}'s {step} step on rank "
                            f"{ranks} ({refused[0][1]}) and cannot fall back to eager: set \"deepcompile\" false in "
                            f"the file's compile section, or pass --compile off")
        dist.print0(f"compile: ZeRO stage {stage} could not be compiled on rank {ranks} ({refused[0][1]}); every "
                    f"rank runs eager")
        self.eager()  # every rank redoes this step eager: ZeRO 1-2 reduce gradients in the order they come,
        return self._eager_retry(inputs, labels, step)  # and a compiled backward brings them in another

    def _eager_retry(self, inputs: list, labels: torch.Tensor, step: str) -> tuple:
        """This micro batch again, eager; an error now is the model's own."""
        try:
            return self.forward(self.engine, self.loss, inputs, labels)
        except Exception as e:  # noqa: BLE001 (one line, not a traceback of the compiler's attempt)
            raise UserError(f"the first {step} step failed on rank {dist.rank()}: {describe(e)}") from None

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
    if any(endings.out_of_memory(e) for e in chain):
        return "fatal", f"out of memory ({describe(error)}); {endings.MEMORY_ADVICE}"
    if any(isinstance(e, torch.distributed.DistError) for e in chain) or not torch_private.is_dynamo_error(error):
        return "fatal", describe(error)
    return "compile", describe(error)
