"""The memory plan of a model under DeepSpeed dicts, measured from its shape alone (for app.tools.plan and for
precision "auto"), and precision "auto" weighed: on a GPU where the plan says bf16 autocast's fp32 weights do not
fit and DeepSpeed's bf16 section's 16-bit weights do, a run takes bf16 weights and says so."""
import contextlib
import dataclasses

import torch

from app.core import lora, models, rollout
from app.data import DataInfo
from app.distributed import dist
from app.ds import auto as ds_auto, internals as ds_internals, run_dict
from app.ds.config import MICRO, zero_stage
from app.ds.internals import torch_private
from app.errors import UserError
from app.memory import activation_count, depth, estimate, host
from app.core.fused_loss import next_token_targets
from app.parallel import activations, tiled

AUTOCAST_BY_AUTO = "bf16 autocast ("  # how precision's note starts when "auto" picked bf16 autocast


def tokens_per_sample(spec, seq_len: int = 0) -> int:
    """seq_len, else the model's positions up to 1024 (a run's --block_size default)."""
    return seq_len or min(spec.max_positions or 1024, 1024)


def workload(task, seq_len: int = 0, image_size: int = 0, frozen: bool = False, sequence: int = 1):
    """activation_count.Work: build() of the model, inputs(micro) -> (inputs, labels), the task's loss, from the
    model's shape alone: a transformers model from its config (no weights, no adapters; build(layers=n) at depth
    n, and its depth where no config value sets a layer apart: depth.layers_of), an image model at image_size.
    frozen (LoRA): the model's weights take no gradient, and the backward runs through it to the input as it does
    to the adapters.
    A sample's sequences go through the model together: a preference pair's two, a GRPO prompt's group (the
    sampling before them: sampling_of). sequence: the sequence-parallel degree; a rank's inputs are its part of
    each sequence, seq_len / sequence tokens (Ulysses' all-to-all trades the rest of the tokens for a part of the
    heads, and memory-efficient attention's activations grow with the tokens, not their square). Where a run's data
    packs rows into blocks (instruction rows, --packing), a block's position ids restart within it, and the mask
    transformers builds from them counts. An image model takes the classes, channels and side of a run's data (the
    task's), else the defaults' at image_size."""
    if task.name == "image_classification":
        if sequence > 1:
            raise UserError(f"sequence parallelism shards text sequences; {task.settings.model} is an image model")
        return _image_workload(task, image_size)
    from app.data.tokenizers import byte_tokenizer
    spec, tokenizer = dataclasses.replace(task.spec, pretrained=""), byte_tokenizer()  # a config.json is enough
    vocab, seq = models.vocab_size(spec.config), tokens_per_sample(spec, seq_len)
    if seq % sequence:
        raise UserError(f"sequence parallel {sequence} does not divide a sample's {seq} tokens: take a sequence "
                        f"length that {sequence} divides")
    seq //= sequence
    classify = task.name == "sequence_classification"
    packed = task.data is not None and task.data.info.packed
    info = DataInfo(2 if classify else 0, task="causal_lm" if not classify else task.name, vocab_size=vocab,
                    seq_len=seq, packed=packed)
    inputs = _text_inputs(task, info)

    def build(layers: int = 0):  # tiled as the run tiles it (--tiled), which build() decides before inputs() are made
        model = models.build_hf(depth.at(spec, layers), info, tokenizer, {})
        if frozen:
            model.requires_grad_(False)
            model.hf.enable_input_require_grads()
        tiled.for_run(model, task, sequence, task.settings.model)
        return model
    return activation_count.Work(build, inputs, task.loss, depth.layers_of(spec.config))


def _text_inputs(task, info: DataInfo):
    """inputs(micro) -> (inputs, labels) of the task's model on random tokens of info's shape: each sample's
    sequences, the labels of a classifier or the tokens themselves, a tiled run's targets, and for packed blocks
    position ids that restart halfway (two rows a block: the mask that keeps them apart is as large however many)."""
    vocab, seq, classify = info.vocab_size, info.seq_len, info.task == "sequence_classification"

    def inputs(b):
        ids = torch.randint(min(vocab, 256), (task.sequences * b, seq))
        if classify:
            return [ids, torch.ones_like(ids)], torch.randint(2, (b,))
        positions = (torch.arange(seq) % max(seq // 2, 1)).repeat(len(ids), 1) if info.packed else None
        if task.fused_logits:
            return [ids, positions, next_token_targets(ids)], ids
        return [ids] + ([positions] if info.packed else []), ids
    return inputs


def _image_workload(task, image_size: int):
    """workload of an image model: the classes, channels and side of the run's data (the task's), else the plan's
    defaults at image_size."""
    builtin = task.settings.model in models.BUILTIN
    info = task.data.info if task.data else DataInfo(10 if builtin else 1000, 1 if builtin else 3,
                                                     image_size or (8 if builtin else 224))
    channels, side, classes = info.in_channels, info.image_size, info.num_classes
    return activation_count.Work(lambda: task.build_model(info, {}), lambda b: (
        [torch.randn(b, channels, side, side)], torch.randint(classes, (b,))), task.loss)


def sampling_of(task, seq_len: int = 0):
    """For a task that samples (online RL), sampling(ds, parameters, ranks) -> MemoryPlan.sampling of a rank under
    the DeepSpeed dict ds: the whole weights gathered under ZeRO-3 (unless --gather_for_generation off), less the
    rank's partition, and per sample its group's key-value cache over the whole sequence (seq_len, else the data's
    prompt and completion) with a decoding step's scores (fp32 logits and the sampler's fp64 copies), under sequence
    parallelism a rank's share of the group's; else None."""
    if not task.sampled:
        return None
    seq = seq_len or (task.data.info.seq_len if task.data is not None else 0) or min(task.spec.max_positions or 1024,
                                                                                     1024)
    config, rows = task.spec.config, task.sampled

    def sampling(ds: dict, parameters: int, ranks: int) -> tuple:
        sixteen = estimate.weight_bytes(ds) == 2
        compute = 2 if sixteen or (ds.get("torch_autocast") or {}).get("enabled") is True else 4
        mine = -(-rows // ds.get("sequence_parallel_size", 1))  # a group's ranks each sample a share whole
        each = rollout.cache_bytes(config, mine, seq, compute) + mine * models.vocab_size(config) * 28
        gathered = zero_stage(ds) == 3 and task.settings.gather_for_generation != "off"
        whole = parameters * (2 if sixteen else 4)
        return (whole - whole // ranks if gathered else 0), each
    return sampling


def plans(work, named: dict, ranks: int, adapters=None, reference: bool = False, sampling=None,
          compiles=None) -> dict:
    """{name: MemoryPlan} of each DeepSpeed dict in named: the model built once on fake tensors for its sizes, one
    fake forward and backward per precision and checkpointing asked; adapters: (rank, targets) of LoRA, or None;
    reference: a frozen copy of the model rides along (preference tuning), its weights alone, as its own engine
    lays them out (run_dict.for_reference: the config's precision, partitioned and offloaded under ZeRO-3 only);
    its no_grad forward's transients, freed before the policy's forward, stay below the policy's own peak;
    sampling: sampling_of(task), online RL's sampling, or None; compiles: compiles(ds), whether a run of ds compiles
    its step (its activations are then the compiled graph's, except under activation checkpointing, counted
    eager), or None (eager)."""
    sizes, trainable, kinds, largest = parameters_of(work.build, adapters)
    cache, found, layered = {}, {}, depth.layered(work)
    for name, ds in named.items():
        dtype = torch.bfloat16 if any((ds.get(s) or {}).get("enabled") is True
                                      for s in ("torch_autocast", "bf16")) else None
        key = (dtype, activations.SECTION in ds, (ds.get("bf16") or {}).get("enabled") is True,
               bool(compiles and compiles(ds)) and activations.SECTION not in ds,
               runs_deepspeed_linear(ds))  # ZeRO-3's linear keeps no bf16 weights for the backward
        if key not in cache:
            with ds_internals.deepspeed_linear() if key[-1] else contextlib.nullcontext():
                cache[key] = depth.measured(work, dtype, *key[1:], by_depth=layered)
        found[name] = estimate.memory_plan(name, ds, ranks, sizes, largest, cache[key][:3], kinds, trainable)
        found[name].largest_layer, found[name].smallest, found[name].counted = largest, *cache[key][3:]
        if sampling is not None:
            found[name].sampling = sampling(ds, sum(sizes), ranks)
        if reference:
            with_reference(found[name], sizes, ds, ranks)
    return found


def runs_deepspeed_linear(ds: dict) -> bool:
    """Whether an engine of ds runs its linears in DeepSpeed's function: ZeRO-3 but memory_efficient_linear off."""
    return zero_stage(ds) == 3 and (ds.get("zero_optimization") or {}).get("memory_efficient_linear") is not False


def with_reference(plan, sizes: list, ds: dict, ranks: int):
    """Add to plan the weights of a frozen copy of the model (preference tuning's reference), as its own engine
    lays them out (run_dict.for_reference: the config's precision, partitioned and offloaded under ZeRO-3 only)."""
    device, host = estimate.model_states(sizes, run_dict.for_reference(ds, ranks), ranks, [False] * len(sizes))
    plan.device["reference"] = device.get("weights", 0)
    if "weights" in host:  # ZeRO-3 with offload_param: the copy's partition waits on the host
        plan.host["reference"] = host["weights"]


def parameters_of(build, adapters=None) -> tuple:
    """(parameter sizes in order, whether each trains (None: all), estimate.comm_kinds, the largest block's
    parameters) of the model build() makes, built on fake tensors; adapters: (rank, targets) of LoRA, or None."""
    with torch_private.fake_tensor_mode():
        model = build()
        sizes, kinds = [p.numel() for p in model.parameters()], estimate.comm_kinds(model)
        trainable = None
        if adapters:  # the frozen base, then the adapters (whose activations, r values a token, are left out)
            added = lora.adapter_sizes(model.hf, adapters[1], adapters[0])
            sizes, trainable = sizes + added, [False] * len(sizes) + [True] * len(added)
        largest = max((sum(p.numel() for p in b.parameters()) for b in activations.blocks(model)), default=0)
    return sizes, trainable, kinds, largest


def micro_of(ds: dict, replicas: int, largest: int) -> tuple:
    """(the micro batch a run of ds takes over replicas data-parallel replicas, whether it is "auto"'s search): as
    written; else the global batch over the accumulation and the replicas, as DeepSpeed derives it; else the
    search's pick, the largest divisor of a replica's share of the global batch (SAMPLES_PER_REPLICA where the
    file gives none) that fits in largest samples (0: none)."""
    written, total = ds.get(MICRO), ds.get("train_batch_size")
    if isinstance(written, int):
        return written, False
    if written is None and isinstance(total, int):
        steps = ds.get("gradient_accumulation_steps")
        return max(1, total // ((steps if isinstance(steps, int) else 1) * replicas)), False
    share = total // replicas if isinstance(total, int) else ds_auto.SAMPLES_PER_REPLICA
    return max((m for m in range(1, min(share, largest) + 1) if share % m == 0), default=0), True


def with_accumulation(ds: dict, replicas: int, micro: int = 0) -> dict:
    """ds with the accumulation DeepSpeed derives where the file sets the global and micro batches (micro: the plan's
    own, else the file's) and no accumulation, or "auto": the plan counts what such a step accumulates."""
    total, steps, micro = ds.get("train_batch_size"), ds.get("gradient_accumulation_steps"), micro or ds.get(MICRO)
    if isinstance(steps, int) or not (isinstance(total, int) and isinstance(micro, int)):
        return ds
    return {**ds, "gradient_accumulation_steps": max(1, total // (micro * replicas))}


def with_bf16_weights(ds: dict) -> dict:
    """ds with DeepSpeed's bf16 section (16-bit weights, fp32 masters) in place of its torch_autocast."""
    return {**{k: v for k, v in ds.items() if k != "torch_autocast"}, "bf16": {"enabled": True}}


def compiles_under(task, choice: str):
    """compiles(ds) for plans: whether a run of ds on a GPU compiles its step, as train.py decides it (--compile
    choice; auto is on for a GPU) with the task's say (eager_because) under the config's ZeRO stage."""
    return lambda ds: choice != "off" and not task.eager_because(zero_stage(ds))


def weigh(ds: dict, note: str, task, settings, replicas: int, memory: int, sequence: int = 1) -> tuple:
    """(ds, note): where "auto" picked bf16 autocast on a GPU of memory bytes and its plan does not fit the micro
    batch while bf16 weights do, the dict with bf16 weights and a note saying why; else both as they were. Only
    transformers models, data parallel, a micro batch set in the JSON (an "auto" one is found at start). sequence:
    the sequence-parallel degree (ZeRO partitions over replicas x sequence ranks; a rank holds 1/sequence of each
    sequence's activations). The activations are the eager step's, whether or not the run compiles: a run whose
    compile fails on any rank trains eager (compiling.Compiled), and the decision must fit it too."""
    micro = ds.get("train_micro_batch_size_per_gpu")
    if not (memory and note.startswith(AUTOCAST_BY_AUTO) and isinstance(micro, int) and task.spec):
        return ds, note
    try:
        return _weighed(ds, note, task, settings, replicas * sequence, memory, micro, sequence)
    except Exception as e:  # the plan advises; a model it cannot build on fake tensors keeps what "auto" picked
        return ds, f"{note}; the memory plan could not weigh bf16 weights here ({type(e).__name__}: {e})"


def _weighed(ds: dict, note: str, task, settings, ranks: int, memory: int, micro: int, sequence: int) -> tuple:
    """weigh's answer; ranks: those ZeRO partitions over (all of them, sequence-parallel ones included)."""
    adapters = (settings.lora_rank, lora.targets_of(settings)) if settings.lora else None
    work = workload(task, settings.block_size, frozen=bool(adapters), sequence=sequence)
    frozen_copy = task.reference_kind == "frozen copy"  # preference tuning's reference
    usable, bf16 = estimate.USABLE * memory, with_bf16_weights(ds)
    sampling = sampling_of(task, settings.block_size)
    autocast_peak = plans(work, {"autocast": ds}, ranks, adapters, frozen_copy, sampling)["autocast"].peak(micro)
    if autocast_peak <= usable:  # the usual case, measured once: autocast stays
        return ds, note
    bf16_peak = plans(work, {"bf16": bf16}, ranks, adapters, frozen_copy, sampling)["bf16"].peak(micro)
    if bf16_peak > usable:
        return ds, note
    return bf16, (f"bf16 (torch_autocast \"auto\" gave way to bf16 weights: the memory plan puts a micro batch of "
                  f"{micro} at {autocast_peak / 1e9:.1f} GB a rank with autocast's fp32 weights and "
                  f"{bf16_peak / 1e9:.1f} GB with bf16 weights, of {usable / 1e9:.1f} GB this GPU gives a run)")


def weighed_for_run(ds: dict, note: str, task, settings, ranks, world) -> tuple:
    """(ds, note) of a run once its data has settled the task: on a GPU precision "auto" weighed by rank 0 (weigh;
    one decision, however the machines differ), then held_by_host. A split model (pipeline, tensor parallel) as it
    was: its bytes are its stages'. Under sequence parallelism ZeRO partitions over every rank and a rank holds its
    part of each sequence."""
    if ranks.split or ranks.tensor > 1:
        return ds, note
    if world.device.type == "cuda":
        gpu = torch.cuda.get_device_properties(world.device).total_memory
        ds, note = dist.broadcast_object(list(weigh(ds, note, task, settings, ranks.replicas, gpu, ranks.sequence))
                                         if dist.is_main() else None)
    held_by_host(ds, task, settings, ranks, world)
    return ds, note


def held_by_host(ds: dict, task, settings, ranks, world):
    """What a rank of ds offloads to the host, planned by rank 0, which every rank holds to its own machine's memory
    for the ranks there: a UserError on every rank where one machine cannot hold it (again once the micro batch
    search has set the accumulation, which ZeRO-2's offload holds gradients for)."""
    if ranks.split or ranks.tensor > 1 or not any(estimate.offloads(ds)):
        return
    each, weights = dist.broadcast_object(list(_offloaded_here(ds, task, settings, ranks)) if dist.is_main() else None)
    if each:
        lines = dist.gather_objects(host.shortfall(each, world.local_world_size, host.host_memory(),
                                                   settings.deepspeed_config, weights,
                                                   bool(task.spec) and not settings.lora, zero_stage(ds) == 3))
        if any(lines):
            raise UserError(next(line for line in lines if line))


def held_after_search(before: dict, after: dict, task, settings, ranks, world):
    """held_by_host once more where the micro batch search (before -> after) set an accumulation above 1, for which
    the offload of ZeRO 1-2 keeps every gradient its partition touches on the host (ZeRO-3's host bytes do not
    depend on it)."""
    accumulation = after.get("gradient_accumulation_steps", 1)
    if after is not before and zero_stage(after) < 3 and isinstance(accumulation, int) and accumulation > 1:
        held_by_host(after, task, settings, ranks, world)


def _offloaded_here(ds: dict, task, settings, ranks) -> tuple:
    """held_by_host's answer on rank 0: (the bytes a rank offloads to the host (0: a model the plan cannot build on
    fake tensors, which goes on unchecked), whether the weights are among them)."""
    try:
        adapters = (settings.lora_rank, lora.targets_of(settings)) if settings.lora else None
        sizes, trainable, _, _ = parameters_of(workload(task, settings.block_size, frozen=bool(adapters))[0], adapters)
    except Exception as e:  # the plan advises: a model it cannot build on fake tensors goes on unchecked
        dist.print0(f"memory plan: what this run offloads is not held to the host's memory: the model could not be "
                    f"built on fake tensors ({type(e).__name__}: {e})")
        return 0, False
    partitions = ranks.replicas * ranks.sequence
    plan = estimate.MemoryPlan(settings.deepspeed_config, sum(sizes), *estimate.model_states(
        sizes, ds, partitions, trainable))
    if task.reference_kind == "frozen copy":
        with_reference(plan, sizes, ds, partitions)
    return host.offloaded(plan), "weights" in plan.host
