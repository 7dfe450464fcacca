"""The activations a micro batch of a model holds on a GPU, counted on a machine without one: the model's forward
and backward run on fake tensors under CUDA's autocast rules (cuda_casts) while a dispatch mode counts the bytes
alive (the eager step), or torch.compile's forward graph of the step is traced and the tensors it keeps for the
backward are counted (the compiled step). What the memory plan (estimate, planner) adds to the model states.
"""
import contextlib
import functools
import threading
import weakref
from typing import Callable, NamedTuple

import torch

from app.ds import internals as ds_internals
from app.ds.internals import torch_private
from app.errors import first_line
from app.memory import cuda_casts
from app.parallel import activations


class Work(NamedTuple):
    """What the plan counts: build() makes the model (build(layers=n), where layers is set, at depth n: depth.py),
    inputs(micro) its (inputs, labels), loss(logits, labels) per-sample losses; layers: the model's depth where
    build can make it at another one and its config sets no layer apart (depth.layers_of), else 0."""
    build: Callable
    inputs: Callable
    loss: Callable
    layers: int = 0


class LiveBytes(torch_private.TorchDispatchMode):
    """Counts the bytes of every tensor storage made under it while they are alive, and their peak. A storage may
    be freed on another thread (a collective's, which held it last): the counts change under a lock, else that
    thread's decrement could land inside this one's read and write of `live`, and be lost."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.seen = 0, 0, set()
        self._lock = threading.RLock()  # reentrant: a free on this thread, inside a count, must not wait on itself

    def _freed(self, key, nbytes):
        with self._lock:
            self.seen.discard(key)
            self.live -= nbytes

    def hold(self, tensor: torch.Tensor):
        """Count tensor's storage from now until it is freed (once, however many tensors view it)."""
        storage = tensor.untyped_storage()
        key, nbytes = storage._cdata, storage.nbytes()
        with self._lock:
            if key in self.seen:
                return
            self.seen.add(key)
            self.live += nbytes
        weakref.finalize(storage, self._freed, key, nbytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in torch_private.tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self.hold(tensor)
        with self._lock:
            self.peak = max(self.peak, self.live)
        return out


def activation_bytes(build, inputs, loss, micro: int, dtype, checkpointed: bool, fake: bool = True,
                     weights16: bool = False) -> int:
    """Peak bytes alive during a forward and backward of a micro batch, gradients excepted (each is dropped as it
    arrives, as a ZeRO bucket takes it; the model states count them). build() makes the model, inputs(micro)
    (inputs, labels), loss(logits, labels) per-sample losses; dtype: the autocast dtype (None: the weights'),
    whose casts are CUDA's (cuda_casts)."""
    return step_bytes(build, inputs, loss, micro, dtype, checkpointed, fake, weights16).peak


class StepBytes(NamedTuple):
    """The bytes of an eager step's activations: their peak, those alive once the loss is computed (autocast's
    casts still cached), as the backward starts (those kept for it) and as it ends (left)."""
    peak: int
    forward: int
    kept: int
    left: int


def step_bytes(build, inputs, loss, micro: int, dtype, checkpointed: bool, fake: bool = True,
               weights16: bool = False) -> StepBytes:
    """activation_bytes' StepBytes."""
    with torch_private.fake_tensor_mode() if fake else contextlib.nullcontext():
        model, x, y, casts = _prepared(build, inputs, micro, dtype, checkpointed, weights16)
        for param in model.parameters():
            if param.requires_grad:  # LoRA's frozen base has none
                param.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        tracker = LiveBytes()
        held = [*model.parameters(), *model.buffers(), *x, y]  # made before: a view of one (a weight's .t()) is free
        tracker.seen.update(t.untyped_storage()._cdata for t in held if isinstance(t, torch.Tensor))
        with tracker, casts or contextlib.nullcontext(), ds_internals.unpacked_positions(x):  # a checkpointed
            # block recomputes casts as in its forward; rows pack several sequences where positions are given
            with casts.forward() if casts else contextlib.nullcontext():
                total = loss(model(*x), y).sum()
                forward = tracker.live
            kept = tracker.live
            torch_private.backward(total)
        return StepBytes(tracker.peak, forward, kept, tracker.live)


def compiled_activation_bytes(build, inputs, loss, micro: int, dtype, weights16: bool = False,
                              recast: bool = False) -> int:
    """What activation_bytes counts, for a compiled step: the bytes torch.compile's forward graph keeps for the
    backward (its partitioner's choice; inductor fuses the rest into kernels that keep nothing), the loss's among
    them. A frozen model (LoRA's base; the plan's model has no adapters) is traced as if its weights trained:
    all-linear adapters keep each layer's input as its weight's gradient would. recast: F.linear is DeepSpeed's
    autograd function (ZeRO-3), which dynamo compiles keeping what it saves, the weight itself, so that its backward
    casts the weight anew: no Linear weight's cast is kept (the H200's ZeRO-3 peak holds none: docs/memory.md)."""
    with torch_private.fake_tensor_mode():
        model, x, y, casts = _prepared(build, inputs, micro, dtype, False, weights16)
        if not any(param.requires_grad for param in model.parameters()):
            model.requires_grad_(True)
        state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        places = [i for i, t in enumerate(x) if isinstance(t, torch.Tensor)]

        def step(state, tensors, y):
            given = list(x)
            for i, t in zip(places, tensors):
                given[i] = t
            return loss(torch.func.functional_call(model, state, tuple(given)), y).sum()
        with casts or contextlib.nullcontext(), casts.forward() if casts else contextlib.nullcontext():
            graph = torch_private.compiled_forward_graph(step, state, [x[i] for i in places], y)
        linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)} if recast else set()
        return kept_bytes(graph, {i for i, value in enumerate(state.values()) if id(value) in linear})


def forward_runs(build, inputs, micro: int) -> bool:
    """True once the model's forward has run on a micro batch of fake tensors (a ValueError where it cannot)."""
    with torch_private.fake_tensor_mode():
        model = build()
        model.train()
        model(*inputs(micro)[0])
    return True


CASTS = ("prims.convert_element_type.default", "aten._to_copy.default")


def kept_bytes(graph, recast: set = frozenset()) -> int:
    """Bytes of the distinct storages a forward graph returns other than its inputs' (the loss and the tensors its
    backward keeps; a view counts once, with the tensor it views), and the gradient of the largest: the backward's
    first (the logits' of a language model) arrives while they are all kept. recast: the positions among the graph's
    inputs of weights whose casts the backward makes anew (compiled_activation_bytes), not kept."""
    def storage(node):
        value = node.meta.get("val") if hasattr(node, "meta") else None
        return value.untyped_storage() if isinstance(value, torch.Tensor) else None
    placeholders = [node for node in graph.graph.nodes if node.op == "placeholder"]
    fresh = {placeholders[i] for i in recast}
    given = {s._cdata for node in placeholders if (s := storage(node)) is not None}
    output = next(node for node in graph.graph.nodes if node.op == "output").args[0]
    output = [node for node in output if not (getattr(node, "op", "") == "call_function" and
                                              str(node.target) in CASTS and node.args[0] in fresh)]
    kept = {s._cdata: s.nbytes() for node in output if (s := storage(node)) is not None and s._cdata not in given}
    return sum(kept.values()) + max(kept.values(), default=0)


def _prepared(build, inputs, micro: int, dtype, checkpointed: bool, weights16: bool) -> tuple:
    """(model in training mode, inputs, labels, CUDA's autocast to dtype (None: none)) of activation_bytes'
    measurement: with weights16 the model is built in dtype and takes its floating inputs in it, as the engine's
    step hands them, with no autocast."""
    if weights16:
        torch.set_default_dtype(dtype)
    try:
        model = build()
    finally:
        torch.set_default_dtype(torch.float32)
    if checkpointed:
        activations.checkpoint_blocks(model)
    model.train()
    x, y = inputs(micro)
    if weights16:
        x = [t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in x]
    return model, x, y, cuda_casts.CudaAutocast(dtype) if dtype and not weights16 else None


def measured(work: Work, dtype, checkpointed: bool, weights16: bool, compiled: bool, recast: bool = False) -> tuple:
    """slope's tuple and how the activations were counted ("compiled", "eager", or eager where the compiled
    graph could not be traced, and why: the eager count is the larger, so the plan errs to the safe side); recast:
    compiled_activation_bytes'."""
    build, inputs, loss = work.build, work.inputs, work.loss
    if compiled:
        try:
            one_runs = _unless_one_value_per_channel(functools.partial(forward_runs, build, inputs)) is not None
            return (*_compiled(functools.partial(compiled_activation_bytes, build, inputs, loss, dtype=dtype,
                                                 weights16=weights16, recast=recast), one_runs), "compiled")
        except Exception as e:  # the plan advises: a step it cannot trace is counted eager
            why = f"eager (the compiled step could not be traced: {type(e).__name__}: {first_line(e)[:120]})"
    return (*_eager(functools.partial(activation_bytes, build, inputs, loss, dtype=dtype,
                                      checkpointed=checkpointed, weights16=weights16)),
            why if compiled else "eager")


def _eager(peak) -> tuple:
    """slope's tuple from peak(micro=...) of an eager step, with 1 sample's peak as measured."""
    one = _unless_one_value_per_channel(peak)
    return slope(one, peak(micro=2), peak(micro=4))


def _compiled(peak, one_runs: bool) -> tuple:
    """slope's tuple from peak(micro=...) of a compiled graph, whose bytes are linear in the micro batch: 1
    sample's peak is the slope's (its graph may differ in shape), where one sample's forward runs (one_runs)."""
    two, four = peak(micro=2), peak(micro=4)
    return slope(two - (four - two) // 2 if one_runs else None, two, four)


def slope(one, two: int, four: int) -> tuple:
    """(bytes per sample, bytes whatever the micro batch, MemoryPlan.least, MemoryPlan.smallest) from the peaks of
    1 (None where one sample cannot train), 2 and 4 samples: the slope from 2 to 4. A model that cannot train on
    one sample (BatchNorm over a 1x1 map: one value per channel) takes 2 samples' peak as its least, so that no
    plan picks a micro batch of 1, and 2 as the smallest it trains on."""
    return (four - two) // 2, two - (four - two), two if one is None else one, 1 if one is not None else 2


def _unless_one_value_per_channel(peak, micro: int = 1):
    """peak(micro=micro), or None where BatchNorm would see one value per channel (a 1x1 map of one sample)."""
    try:
        return peak(micro=micro)
    except ValueError as e:
        if "value per channel" not in str(e):
            raise
        return None
