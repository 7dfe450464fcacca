"""The memory plan: what one rank of a data-parallel config holds, on its GPU and on the host, and what each sample
of a micro batch adds, worked out from the model's shape alone (no weight is allocated, no GPU is needed).

Model states follow DeepSpeed's own layout, as the engine holds it (checked against a real engine's tensors):
ZeRO 1-2 partition the optimizer state and keep an fp32 master partition; ZeRO-2 keeps the whole gradient of every
parameter its partition touches, ZeRO-1 every gradient until the step (unless overlap_comm reduces them as they
arrive); ZeRO-3 partitions each parameter on its own. Activations are measured (activation_count): the eager
step's on fake tensors, or the tensors the compiled step's graph keeps, in the precision the config gets on a GPU.
The peak: the states the forward holds and the larger of its activations and the backward's end (between_steps)."""
import math
from dataclasses import dataclass, field

import torch

from app.ds.config import buckets_within, zero_stage
from app.memory import optimizer_states

FP32 = 4
# What a GPU gives a run of its memory: the CUDA context and the caching allocator's fragmentation take the rest.
USABLE = 0.92


@dataclass
class MemoryPlan:
    """One config's bytes per rank; peak(micro) adds the activations of a micro batch."""
    config: str
    parameters: int
    device: dict
    """weights, gradients, optimizer (moments), masters (fp32 copies), working (buckets, gathered layers), and with
    preference tuning's frozen copy, reference (its weights)."""
    host: dict = field(default_factory=dict)
    per_sample: int = 0
    fixed: int = 0
    """Activation bytes of one sample, and those a micro batch needs whatever its size (weights cast to bf16)."""
    least: int = 0
    """The activation peak of a micro batch of one, measured: a transient of the weights' size (a gradient, a
    cast) can outgrow one sample's activations, so a small micro batch peaks at no less than this."""
    trained: int = 0
    """Parameters that train (fewer than all with LoRA)."""
    smallest: int = 1
    """The fewest samples a micro batch trains on (2 where BatchNorm would see a 1x1 map of one sample)."""
    counted: str = "eager"
    """How the activations were counted: "compiled" (the compiled graph's), "eager", or eager and why."""
    sampling: tuple = (0, 0)
    """Online RL's sampling, before the training forward and freed by then: (bytes whatever the micro batch (the
    whole weights gathered under ZeRO-3, less the rank's partition), bytes per sample (its group's key-value cache
    and a decoding step's scores))."""
    freed: int = 0
    """Bytes of the device states that live from the backward to the optimizer step only, not through the forward
    (between_steps)."""
    after: int = 0
    """The most bytes the backward's end and the optimizer step hold beyond the states the forward holds, freed
    ones included (between_steps)."""

    def states(self) -> int:
        return sum(self.device.values())

    def peak(self, micro: int) -> int:
        """Predicted peak of the GPU's allocated bytes of one rank at this micro batch: the states the forward holds,
        and the larger of its activations (or the sampling before it) and what the backward and step add to them."""
        fixed, each = self.sampling
        return self.states() - self.freed + max(self.least, self.fixed + micro * self.per_sample,
                                                fixed + micro * each, self.after)

    def largest_micro(self, memory: int) -> int:
        """The largest micro batch whose peak fits in memory bytes of GPU (0: not even one sample)."""
        room = USABLE * memory - self.states() + self.freed
        if not self.per_sample or room < max(self.least, self.sampling[0] + self.sampling[1], self.after):
            return 0
        fits = int((room - self.fixed) // self.per_sample)
        return max(0, min(fits, int((room - self.sampling[0]) // self.sampling[1])) if self.sampling[1] else fits)


def _partition(total: int, ranks: int) -> int:
    """Elements of one rank's partition of a flat ZeRO 1-2 buffer: equal parts, each a whole number of pairs."""
    return 2 * math.ceil(total / ranks / 2) if ranks > 1 else total


def _touched(sizes: list, rank: int, part: int) -> int:
    """Elements of the parameters that overlap a rank's partition [rank * part, (rank + 1) * part): a ZeRO 1-2 rank
    keeps each of their gradients whole until the step."""
    start, total = 0, 0
    for size in sizes:
        if start < (rank + 1) * part and start + size > rank * part:
            total += size
        start += size
    return total


def weight_bytes(ds: dict) -> int:
    """Bytes of a weight (and of its gradient) under ds: 2 with DeepSpeed's bf16 or fp16 section, else fp32's 4
    (bf16 autocast keeps fp32 weights)."""
    return 2 if any((ds.get(name) or {}).get("enabled") is True for name in ("bf16", "fp16")) else FP32


def trained(sizes: list, trainable: list = None) -> list:
    """The sizes of the parameters that train (trainable: whether each one does; None: all)."""
    return [size for size, trains in zip(sizes, trainable or [True] * len(sizes)) if trains]


def accumulates(ds: dict) -> bool:
    """Whether ds accumulates gradients over several micro batches a step ("auto" and unset: one, as a run takes
    them unless its micro batch search raises the accumulation, which the plan is then run again for)."""
    steps = ds.get("gradient_accumulation_steps", 1)
    return isinstance(steps, int) and steps > 1


def _reduced_as_they_arrive(ds: dict, stage: int) -> bool:
    """Whether a ZeRO 1-2 rank drops each gradient it does not own as backward makes it: always under ZeRO-2;
    under ZeRO-1 only with overlap_comm and no accumulation (DeepSpeed's stage 1 otherwise keeps every gradient
    whole until the accumulation boundary, then reduces them all at once)."""
    zero = ds.get("zero_optimization") or {}
    return stage == 2 or zero.get("overlap_comm") is True and not accumulates(ds)


def offloads(ds: dict) -> tuple:
    """(where ZeRO offloads the optimizer, where it offloads the weights) under ds: "cpu", "nvme" or "" (not)."""
    zero = ds.get("zero_optimization") or {}
    return tuple("" if (where := str((zero.get(section) or {}).get("device") or "none")) == "none" else where
                 for section in ("offload_optimizer", "offload_param"))


def model_states(sizes: list, ds: dict, ranks: int, trainable: list = None) -> tuple:
    """({what: bytes} on the device, {what: bytes} on the host) of the largest rank's model states at the moment
    its gradients peak.

    sizes: the model's parameter sizes in order; trainable: whether each one trains (None: all; LoRA freezes the
    base model, whose weights then have no gradient, optimizer state nor master copy). Weights in fp32 (autocast
    keeps them so) unless the config's bf16 or fp16 section makes them 16-bit.
    """
    width, states = weight_bytes(ds), FP32 * optimizer_states.state_words(ds)
    learnt = trained(sizes, trainable)
    stage, total, learnt_total = zero_stage(ds), sum(sizes), sum(learnt)
    offload, offload_params = offloads(ds)
    if stage == 0:
        return {"weights": width * total, "gradients": width * learnt_total, "optimizer": states * learnt_total,
                "masters": FP32 * learnt_total if width == 2 else 0}, {}
    if stage == 3:
        part = sum(math.ceil(size / ranks) for size in learnt)
        grads, weights = part, sum(math.ceil(size / ranks) for size in sizes)  # frozen weights are partitioned too
    else:  # the flat buffers hold the trained parameters only; frozen weights stay whole on every rank
        part, weights = _partition(learnt_total, ranks), total
        grads = max(_touched(learnt, rank, part) for rank in range(ranks)) \
            if _reduced_as_they_arrive(ds, stage) else learnt_total
    device = {"weights": width * weights, "gradients": width * grads}
    host = {}
    if offload:
        host = _offloaded(ds, stage, width, part, learnt, ranks)
        held = 0 if stage == 3 or _reduced_as_they_arrive(ds, stage) else grads  # ZeRO-1's, whole till the boundary
        device["gradients"] = 0 if stage == 3 else width * (max(learnt, default=0) + held)  # and a gradient's staging
        kept = part - host["masters"] // FP32 if offload == "cpu" else 0  # the sub-groups ZeRO-3's ratio keeps
        device.update({"optimizer": states * kept, "masters": FP32 * kept, "gradients": FP32 * kept} if kept else {})
    else:
        device.update({"optimizer": states * part, "masters": FP32 * part})
    if offload_params and stage == 3:  # DeepSpeed offloads weights under ZeRO-3 only, NVMe's to disk
        weights = device.pop("weights")
        host.update({"weights": weights} if offload_params == "cpu" else {})
    return device, host


def offloaded_share(zero: dict, parts: list) -> int:
    """Elements of a ZeRO-3 rank's partitions (parts: each trained parameter's, in order) whose optimizer
    offload_optimizer moves to the host: DeepSpeed's sub-groups close at the parameter that brings them to
    sub_group_size elements, and its ratio offloads the last of them, as many as it gives (all of them at 1)."""
    groups, ratio = sub_groups(zero, parts), float((zero.get("offload_optimizer") or {}).get("ratio", 1.0))
    return sum(groups[int((1 - ratio) * len(groups)):])


def sub_groups(zero: dict, parts: list) -> list:
    """Elements of each of ZeRO-3's optimizer sub-groups of a rank (parts: each trained parameter's partition, in
    order): a group closes at the parameter that brings it to sub_group_size elements."""
    limit, groups, size = int(zero.get("sub_group_size", 1e9)), [], 0
    for index, part in enumerate(parts):
        size += part
        if size >= limit or index == len(parts) - 1:
            groups, size = groups + [size], 0
    return groups


def between_steps(learnt: list, ds: dict, ranks: int, device: dict) -> tuple:
    """(MemoryPlan.freed, MemoryPlan.after) of a rank's device states (model_states' and working_bytes'; learnt: the
    trained parameters' sizes, in order), as DeepSpeed 0.19.8 holds them (a real engine's step: tests/e2e/test_plan.py).
    ZeRO 0-2 make their gradients in the backward and free them at the step, and their reduce buffers with them; with
    gradient accumulation the gradients live on through the forwards to the last micro batch's step. The largest
    gradient counts beside the activations: a language model's output layer makes it first, and a compiled backward,
    one graph, holds every gradient it makes to its end (gpt2-124m's tied embedding on an H200: docs/memory.md), so
    ZeRO-2's are all whole there at once (an eager step's counted so too). ZeRO-2 flushes a bucket through a flat copy
    of it (allreduce_bucket) beside the gradient partition an earlier flush made. ZeRO-3 keeps its flat gradient
    partition, and works with its buckets through the forward. The step copies: ZeRO's norm one gradient at a time in
    fp64; ZeRO 1-2 the flat gradient partition in the weights' dtype, then in fp32 (ZeRO-3: each optimizer
    sub-group's); ZeRO 0 with 16-bit weights each gradient in fp32 (masters_copies). Offloading the optimizer: every
    state as held through the step (0, 0)."""
    if offloads(ds)[0]:
        return 0, 0
    width, stage, parts = weight_bytes(ds), zero_stage(ds), [math.ceil(size / ranks) for size in learnt]
    copy = width + (FP32 if width == 2 else 0)  # the flat partition, then its fp32 copy (none for fp32 weights)
    if stage == 3:
        group = max(sub_groups(ds.get("zero_optimization") or {}, parts), default=0)
        return 0, max(8 * max(parts, default=0), copy * group)
    grads = 0 if accumulates(ds) else device["gradients"]  # with accumulation the forward holds them
    largest, working = max(learnt, default=0), device.get("working", 0)
    first = min(grads, width * largest)  # the output layer's, made beside nearly all the activations
    made = width * sum(learnt)  # a compiled backward's gradients, whole at once (beside any accumulated)
    if stage == 0:
        return grads - first + working, max(grads + working, made, masters_copies(ds, learnt, grads)) - first
    part, bucket = _partition(sum(learnt), ranks), buckets_within(ds, sum(learnt))["zero_optimization"]
    steps = grads + working + max(8 * min(largest, part), copy * part)
    flush = grads + working + min(width * int(bucket["reduce_bucket_size"]), made) if stage == 2 else 0
    return grads - first + working, max(steps, made + working, flush) - first


def masters_copies(ds: dict, learnt: list, grads: int) -> int:
    """Bytes ZeRO 0's step with 16-bit weights holds for its fp32 masters (learnt: the trained parameters' sizes;
    grads: the 16-bit gradients' bytes the forward does not hold): bf16 with torch's fused Adam takes the app's step
    (ds_internals.step_bf16_weights_on_device), which frees each 16-bit gradient as it copies it; DeepSpeed's keep
    them, beside an fp32 copy of each (FP16_UnfusedOptimizer) and their flat concatenation (FP16_Optimizer)."""
    if weight_bytes(ds) == FP32:
        return 0
    params = (ds.get("optimizer") or {}).get("params") or {}
    if params.get("torch_adam") is not True:
        return grads + 2 * FP32 * sum(learnt)
    if (ds.get("bf16") or {}).get("enabled") is True and params.get("fused") is True:
        return FP32 * sum(learnt) + 2 * max(learnt, default=0)
    return grads + FP32 * sum(learnt)


def _offloaded(ds: dict, stage: int, width: int, part: int, learnt: list, ranks: int) -> dict:
    """{what: bytes} the host keeps of a rank's states under offload_optimizer, as DeepSpeed 0.19.8 holds them (a
    real engine's tensors: tests/e2e/test_plan.py): the fp32 masters, Adam's moments and the masters' fp32 gradient
    (ZeRO-3 on NVMe: on disk); ZeRO-3 also its flat gradient partition in the weights' dtype; ZeRO 1-2 (which take
    NVMe for the CPU) a copy of the weights' partition, a staging buffer of the largest parameter and, with gradient
    accumulation, the gradients of the parameters the partition touches, whole, in the weights' dtype."""
    zero, states = ds.get("zero_optimization") or {}, FP32 * optimizer_states.state_words(ds)
    if stage == 3:
        moved = offloaded_share(zero, [math.ceil(size / ranks) for size in learnt]) \
            if offloads(ds)[0] == "cpu" else 0
        return {"optimizer": states * moved, "masters": FP32 * moved, "gradients": FP32 * moved + width * part}
    touched = max(_touched(learnt, rank, part) for rank in range(ranks)) if accumulates(ds) else 0
    return {"optimizer": states * part, "masters": FP32 * part, "gradients": FP32 * part,
            "copies": width * (part + max(learnt, default=0) + touched)}


# Modules whose weights DeepSpeed's torch_autocast sends in its dtype (runtime/torch_autocast.py: exact class)
LOWER_PRECISION_SAFE = ("Linear", "Conv1d", "Conv2d", "Conv3d")


def comm_kinds(model) -> tuple:
    """(whether the model has weights DeepSpeed's autocast would communicate in its dtype, whether it has others)."""
    safe = {id(p) for m in model.modules() if type(m).__name__ in LOWER_PRECISION_SAFE and
            type(m).__module__.startswith("torch.nn") for p in m.parameters(recurse=False)}
    params = list(model.parameters())
    return any(id(p) in safe for p in params), any(id(p) not in safe for p in params)


def bucket_bytes(total: int, ds: dict, kinds: tuple = (True, True)) -> int:
    """ZeRO's reduce buckets, as DeepSpeed allocates them: reduce_bucket_size elements each (the app caps an unset
    size at the model's parameters: ds_config.buckets_within), one per gradient communication dtype, two of each for
    ZeRO 1-2 with overlap_comm. Under torch_autocast, Linear and Conv weights communicate in the autocast dtype
    unless lower_precision_safe_modules is [] (kinds: comm_kinds of the model), so there may be two dtypes:
    ZeRO 1-2's buckets hold the weights' dtype, ZeRO-3's each its own."""
    zero = buckets_within(ds, total).get("zero_optimization") or {}
    elements, stage, width = int(zero["reduce_bucket_size"]), zero_stage(ds), weight_bytes(ds)
    autocast = ds.get("torch_autocast") or {}
    lower, full = kinds if autocast.get("enabled") is True and autocast.get("lower_precision_safe_modules") != [] \
        else (False, True)
    if stage == 3:
        return elements * (width * full + 2 * lower)
    overlap = zero.get("overlap_comm", False) is True
    return elements * width * (full + lower) * (2 if overlap else 1)


def working_bytes(sizes: list, ds: dict, ranks: int, largest_block: int, kinds: tuple = (True, True),
                  learnt: int = None) -> int:
    """The transient buffers of a step: the flat gradient all-reduce (ZeRO 0 on several ranks), ZeRO's reduce
    buckets (under ZeRO-3's reduce-scatter also the flat copy DeepSpeed's reduce_scatter_coalesced makes of a
    bucket as it flushes it), ZeRO-3's gathered layers (the largest block and the next prefetched) and its
    parameters too small to partition (kept whole on every rank). learnt: the elements that train (None: all)."""
    stage, total = zero_stage(ds), sum(sizes)
    learnt = total if learnt is None else learnt
    zero = ds.get("zero_optimization") or {}
    if stage == 0:  # flattened in the gradients' dtype, the weights'
        return weight_bytes(ds) * min(learnt, int(5e8)) if ranks > 1 else 0
    bucket = bucket_bytes(learnt, ds, kinds)
    if stage < 3:
        return bucket
    persistent = sum(size for size in sizes if size < int(zero.get("stage3_param_persistence_threshold", 1e5)))
    prefetch = int(zero.get("stage3_prefetch_bucket_size", 5e7))
    flat = bucket if zero.get("reduce_scatter", True) is not False else 0  # a flushed bucket's flat copy
    return bucket + flat + FP32 * (min(total, 2 * largest_block + prefetch) + persistent)


def memory_plan(config: str, ds: dict, ranks: int, sizes: list, largest_block: int, measured: tuple,
                kinds: tuple = (True, True), trainable: list = None) -> MemoryPlan:
    """The MemoryPlan of one config: measured is (bytes of one sample, bytes of a micro batch whatever its size); kinds:
    comm_kinds of the model; trainable: whether each parameter trains (None: all)."""
    device, host = model_states(sizes, ds, ranks, trainable)
    learnt = trained(sizes, trainable)
    device["working"] = working_bytes(sizes, ds, ranks, largest_block, kinds, sum(learnt))
    freed, after = between_steps(learnt, ds, ranks, device)
    return MemoryPlan(config, sum(sizes), device, host, *measured, trained=sum(learnt), freed=freed, after=after)
