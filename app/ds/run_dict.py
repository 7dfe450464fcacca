"""The DeepSpeed dict of a run: planned from the JSON before the data is read, then made final once, when the micro
batch, the run's steps and the checkpoint it resumes are known. Nothing changes the final dict afterwards: the
engine is built from exactly it, and the run's checkpoints record it."""
from app.ds import auto as ds_auto
from app.ds import config as ds_config
from app.ds import precision

TIMERS_OFF = {"throughput": {"enabled": False}}
"""The app times its own steps. DeepSpeed's throughput timer would synchronise the GPU in every forward and, read by
its forward hook, recompile a compiled model at each of the first steps: off unless the JSON sets "timers"."""
DEEPCOMPILE_OFF = ("DeepSpeed's DeepCompile runs on CUDA devices only: on CPU ranks torch.compile compiles the step "
                   "where --compile says (auto: eager on a CPU)")
MONITORS = ("tensorboard", "wandb", "comet", "csv_monitor")
"""DeepSpeed's monitor sections. Only the run's engine reports: a trial's or a reference's would start a tracker run
of its own and write its steps among the run's."""


def planned(ds: dict, where: str, device, replicas: int, facts: ds_auto.Facts) -> tuple:
    """(dict, what "auto" filled, why precision was picked), settled before anything is written, so that a mistake
    in the JSON ends the run with the output folder untouched: precision for this rank's device, "auto" filled,
    batch sizes fitted to the data-parallel replicas."""
    ds, note = precision.resolve_precision(ds, where, device=device)
    ds, filled = ds_auto.fill(ds, facts, replicas)
    return ds_config.resolve_batch_sizes(without_deepcompile_on_cpu(ds, facts, filled), replicas, where), filled, note


def without_deepcompile_on_cpu(ds: dict, facts: ds_auto.Facts, filled: dict) -> dict:
    """ds with DeepSpeed's DeepCompile ("compile": {"deepcompile": true}) turned off where the ranks run on the CPU,
    said in filled: it runs on CUDA devices only, and DeepSpeed would try to build its CUDA op there and fail. The
    same file then trains on a laptop, compiled by torch.compile where --compile says."""
    if not (facts.cpu and isinstance(ds.get("compile"), dict) and _deepcompile_asked(ds["compile"])):
        return ds
    filled["compile.deepcompile"] = DEEPCOMPILE_OFF
    return {**ds, "compile": {**ds["compile"], "deepcompile": False}}


def _deepcompile_asked(section: dict) -> bool:
    """The compile section's deepcompile as DeepSpeed reads it (its config model's bool: true, "true", 1, "on"...);
    a section it refuses is left for its own check to refuse."""
    from deepspeed.compile.config import CompileConfig  # here: only a file with a compile section needs it
    try:
        return CompileConfig(**section).deepcompile
    except (ValueError, TypeError):  # pydantic's ValidationError is a ValueError
        return False


def final(ds: dict, filled: dict, steps: int, universal: bool, trainable: int, tensor: int) -> dict:
    """The run's dict: the planned one (its micro batch settled) with the scheduler's lengths from the run's
    optimizer steps ("auto", or a length the scheduler needs), a universal checkpoint's loading where the run
    resumes on another world size, and what the engine needs besides (for_engine)."""
    ds = ds_config.fill_scheduler_length(ds_auto.fill_lengths(ds, steps, filled), steps)
    if universal:
        ds = {**ds, "checkpoint": {**ds.get("checkpoint", {}), "load_universal": True}}
    return for_engine(ds, trainable, tensor)


def for_trial(ds: dict, micro: int, replicas: int) -> dict:
    """The dict of a micro batch search's trial engine (for_engine makes it whole once its model is built): the
    planned dict at `micro` samples, one step of no accumulation. A length past the warm-up keeps DeepSpeed from
    warning that it is shorter; "auto" lengths wait for the run's step count, which the micro batch decides: one
    step stands in. No monitor reports it."""
    trial = ds_config.resolve_batch_sizes({**_unmonitored(ds), ds_config.MICRO: micro,
                                           "gradient_accumulation_steps": 1, "train_batch_size": micro * replicas},
                                          replicas, "a trial")
    trial = ds_auto.fill_lengths(trial, 1, {})
    return ds_config.fill_scheduler_length(trial, max(1, (trial.get("scheduler") or {}).get("params", {}).get(
        "warmup_num_steps", 1)))


def for_benchmark(ds: dict, micro: int, facts: ds_auto.Facts, replicas: int, steps: int, where: str) -> tuple:
    """(the dict of app.tools.bench's engine, what "auto" filled): for_engine makes the dict whole once its model is
    built. The JSON at `micro` samples and no accumulation, its "auto" values filled as a run fills them, the
    scheduler as long as the benchmark's steps; no monitor reports it."""
    ds, filled = ds_auto.fill({**_unmonitored(ds), ds_config.MICRO: micro, "gradient_accumulation_steps": 1}, facts,
                              replicas)
    ds = without_deepcompile_on_cpu(ds, facts, filled)
    ds = ds_auto.fill_lengths(ds_config.resolve_batch_sizes(ds, replicas, where), steps, {})
    return ds_config.fill_scheduler_length(ds, steps), filled


def trainable(model) -> int:
    """The parameters of model that train (with LoRA, the adapters alone), whole where ZeRO-3 has partitioned
    them as they were made (a partitioned parameter's own numel is 0: its ds_numel is the whole's)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)


def for_engine(ds: dict, trainable: int, tensor: int) -> dict:
    """ds with what an engine of it needs that the JSON leaves out: DeepSpeed's throughput timer off (TIMERS_OFF),
    ZeRO's reduce bucket no larger than the trainable parameters, and under AutoTP (tensor > 1) train_batch_size
    left for DeepSpeed to derive (it checks it against the whole world, not the replicas)."""
    ds = ds_config.buckets_within({"timers": TIMERS_OFF, **ds}, trainable)
    return {k: v for k, v in ds.items() if k != "train_batch_size"} if tensor > 1 else ds


def for_reference(ds: dict, replicas: int) -> dict:
    """The dict of a frozen reference's engine: the run's precision and, under ZeRO-3, its partitioning (and
    parameter offload); no optimizer, scheduler nor optimizer state to shard, no monitor; batch sizes of one (it
    never steps, and is built before the run's micro batch is settled)."""
    ref = {k: v for k, v in _unmonitored(ds).items() if k not in ("optimizer", "scheduler")}
    ref.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, train_batch_size=replicas)
    zero = ds.get("zero_optimization") or {}
    ref["zero_optimization"] = {k: v for k, v in zero.items() if k != "offload_optimizer"} \
        if zero.get("stage", 0) == 3 else {"stage": 0}
    return ref


def _unmonitored(ds: dict) -> dict:
    return {k: v for k, v in ds.items() if k not in MONITORS}
