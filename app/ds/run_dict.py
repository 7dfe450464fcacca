"""The DeepSpeed dict of a run: planned from the JSON before the data is read, then made final once, when the micro
batch, the run's steps and the checkpoint it resumes are known. Nothing changes the final dict afterwards: the
engine is built from exactly it, and the run's checkpoints record it."""
from app.ds import auto as ds_auto
from app.ds import config as ds_config
from app.ds import precision

TIMERS_OFF = {"throughput": {"enabled": False}}
"""The app times its own steps. DeepSpeed's throughput timer would synchronise the GPU in every forward and, read by
its forward hook, recompile a compiled model at each of the first steps: off unless the JSON sets "timers"."""


def planned(ds: dict, where: str, device, replicas: int, facts: ds_auto.Facts) -> tuple:
    """(dict, what "auto" filled, why precision was picked), settled before anything is written, so that a mistake
    in the JSON ends the run with the output folder untouched: precision for this rank's device, "auto" filled,
    batch sizes fitted to the data-parallel replicas."""
    ds, note = precision.resolve_precision(ds, where, device=device)
    ds, filled = ds_auto.fill(ds, facts, replicas)
    return ds_config.resolve_batch_sizes(ds, replicas, where), filled, note


def final(ds: dict, filled: dict, steps: int, universal: bool, trainable: int, tensor: int) -> dict:
    """The run's dict: the planned one (its micro batch settled) with the scheduler's lengths from the run's
    optimizer steps ("auto", or a length the scheduler needs), a universal checkpoint's loading where the run
    resumes on another world size, and what the engine needs besides (for_engine)."""
    ds = ds_config.fill_scheduler_length(ds_auto.fill_lengths(ds, steps, filled), steps)
    if universal:
        ds = {**ds, "checkpoint": {**ds.get("checkpoint", {}), "load_universal": True}}
    return for_engine(ds, trainable, tensor)


def trainable(model) -> int:
    """The parameters of model that train (with LoRA, the adapters alone)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def for_engine(ds: dict, trainable: int, tensor: int) -> dict:
    """ds with what an engine of it needs that the JSON leaves out: DeepSpeed's throughput timer off (TIMERS_OFF),
    ZeRO's reduce bucket no larger than the trainable parameters, and under AutoTP (tensor > 1) train_batch_size
    left for DeepSpeed to derive (it checks it against the whole world, not the replicas)."""
    ds = ds_config.fit_buckets({"timers": TIMERS_OFF, **ds}, trainable)
    return {k: v for k, v in ds.items() if k != "train_batch_size"} if tensor > 1 else ds
