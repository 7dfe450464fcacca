"""The DeepSpeed JSON as the ecosystem writes it: "auto" filled in once at start, a missing optimizer or batch size
given the app's default, and what was filled said in one block and saved with the run (keys older DeepSpeed took
are put as today's reads them before: app/ds/older.py).

transformers and accelerate read "auto" as "the training program fills this in". Here each value comes from, in
order: the app's flag that owns it; the model (bucket sizes from its hidden size, as DeepSpeed's docs advise);
the data and the world size (the batch triple); else the app's documented default for the job (docs/configs.md, "auto").
"""
import copy
import json
from dataclasses import dataclass
from pathlib import Path

from app.errors import UserError

AUTO = "auto"
SAMPLES_PER_REPLICA = 32  # the shipped configs' micro batch: the global batch per replica when the file sets none
LR_PRETRAINED, LR_SCRATCH = 2e-5, 2e-3  # fine-tuning loaded weights; training from the config (ds_configs/)
WARMUP_SHARE = 0.05  # of the run's optimizer steps
FILE = "deepspeed_auto.json"

# Every key the app fills in for "auto": where its value comes from (docs/configs.md's table says the same).
FILLED = {
    "train_batch_size": "micro batch x accumulation x data-parallel ranks",
    "train_micro_batch_size_per_gpu": "the largest that runs on every rank, found at start",
    "gradient_accumulation_steps": "train_batch_size / (micro batch x ranks), else 1",
    "gradient_clipping": "the app's default, 1.0",
    "fp16.enabled": "the device (docs/gpu.md, \"Precision\")",
    "bf16.enabled": "the device (docs/gpu.md, \"Precision\")",
    "torch_autocast.enabled": "the device (docs/gpu.md, \"Precision\")",
    "optimizer.params.lr": f"the app's default: {LR_PRETRAINED} fine-tuning loaded weights, {LR_SCRATCH} from scratch",
    "optimizer.params.betas": "the app's default, [0.9, 0.999]",
    "optimizer.params.eps": "the app's default, 1e-8",
    "optimizer.params.weight_decay": "the app's default, 0.0",
    "scheduler.params.warmup_min_lr": "0",
    "scheduler.params.warmup_max_lr": "the optimizer's lr",
    "scheduler.params.warmup_num_steps": f"{WARMUP_SHARE:.0%} of the run's optimizer steps",
    "scheduler.params.total_num_steps": "the run's optimizer steps (--max_steps or --epochs)",
    "zero_optimization.reduce_bucket_size": "the model: hidden size squared (else DeepSpeed's, at most the model)",
    "zero_optimization.stage3_prefetch_bucket_size": "the model: its largest transformer block, so the next block "
                                                     "is gathered while one computes (else DeepSpeed's)",
    "zero_optimization.leaf_module.classes": "the model: its transformer block, gathered whole with one hook (else "
                                             "DeepSpeed's: a hook on every submodule)",
    "zero_optimization.stage3_param_persistence_threshold": "0 on CPU ranks with leaf blocks (over gloo DeepSpeed "
                                                            "gathers each persistent weight alone after every step); "
                                                            "else the model's 10 x hidden size (else DeepSpeed's)",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "true: a save gathers the whole model",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": "true: a save gathers the whole model",
}
# What a filled-in key holds while the strict check runs, before the model and the run's length are known.
STAND_INS = {"optimizer.params.betas": [0.9, 0.999], "gradient_clipping": 1.0, "optimizer.params.lr": 1e-3,
             "optimizer.params.eps": 1e-8, "optimizer.params.weight_decay": 0.0,
             "zero_optimization.leaf_module.classes": []}


@dataclass
class Facts:
    """What the filled-in values depend on besides the JSON."""
    pretrained: bool = False
    hidden: int = 0
    """The model's hidden size (0: not a transformers model)."""
    blocks: tuple = ()
    """The class names of its transformer blocks (the classes it names not to split)."""
    block_size: int = 0
    """Parameters of its largest block."""
    cpu: bool = False
    """The ranks run on the CPU: their collectives go over gloo, one message at a time."""


def auto_paths(value, prefix: tuple = ()) -> list:
    """The key paths whose value is "auto"."""
    if isinstance(value, dict):
        return [p for key, sub in value.items() for p in auto_paths(sub, (*prefix, key))]
    return [prefix] if value == AUTO else []


def _dotted(path: tuple) -> str:
    return ".".join(map(str, path))


def _set(ds: dict, path: tuple, value):
    for key in path[:-1]:
        ds = ds[key]
    if value is None:
        ds.pop(path[-1], None)
    else:
        ds[path[-1]] = value


def check(ds: dict, where: str):
    """One line for "auto" where the app fills nothing in."""
    for path in auto_paths(ds):
        if _dotted(path) not in FILLED:
            raise UserError(f"{where}: {_dotted(path)} is \"auto\", which the app does not fill in (it does for "
                            f"the keys docs/configs.md lists under \"auto\"); give it a value")


def stand_in(ds: dict) -> dict:
    """ds with each "auto" the checks cannot read as a value of its kind: numbers where numbers go, batch keys
    left for the batch check, precision switches left for the device."""
    ds = copy.deepcopy(ds)
    for path in sorted(auto_paths(ds), key=lambda p: _dotted(p) == "scheduler.params.warmup_max_lr"):  # lr first
        key = _dotted(path)
        if key in STAND_INS:
            _set(ds, path, STAND_INS[key])
        elif key.startswith(("zero_optimization.", "scheduler.params.")) and "leaf_module" not in key:
            _set(ds, path, True if key.endswith("_on_model_save") else 0 if key.endswith("min_lr") else 1)
    _fill_batch(ds, 1, {})
    return ds


def default_optimizer(ds: dict, lr: float) -> dict:
    """The app's optimizer where the file has none: AdamW, torch's fused kernel unless the optimizer is offloaded
    (DeepSpeed's CPU Adam steps there)."""
    offload = ((ds.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device") or "none"
    params = {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    return {"type": "AdamW", "params": {**params, **({"torch_adam": True, "fused": True} if offload == "none"
                                                     else {})}}


DEFAULT_SCHEDULER = {"type": "WarmupCosineLR", "params": {"warmup_num_steps": AUTO, "total_num_steps": AUTO,
                                                          "warmup_type": "linear", "cos_min_ratio": 0.01}}


def fill(ds: dict, facts: Facts, replicas: int) -> tuple:
    """(ds with "auto" filled in where the JSON and the model say, {key: where its value comes from}); the
    scheduler's lengths wait for the run's step count (fill_lengths), the micro batch for the search."""
    ds, said = copy.deepcopy(ds), {}
    lr = LR_PRETRAINED if facts.pretrained else LR_SCRATCH
    if "optimizer" not in ds:
        ds["optimizer"] = default_optimizer(ds, lr)
        weights = "loaded weights" if facts.pretrained else "from scratch"
        said["optimizer"] = f"the app's default, AdamW at lr {lr} ({weights}): the file has none"
        if "scheduler" not in ds:
            ds["scheduler"] = copy.deepcopy(DEFAULT_SCHEDULER)
            said["scheduler"] = "the app's default, a linear warm-up into a cosine decay: the file has none"
    hidden, leaves = facts.hidden, _value(ds, "zero_optimization.leaf_module.classes")
    leaves = list(facts.blocks) if leaves == AUTO else leaves  # a leaf block's one gather brings its small weights
    persist = 0 if facts.cpu and leaves else 10 * hidden or None
    values = {"gradient_clipping": 1.0, "optimizer.params.lr": lr, "optimizer.params.betas": [0.9, 0.999],
              "optimizer.params.eps": 1e-8, "optimizer.params.weight_decay": 0.0,
              "scheduler.params.warmup_min_lr": 0,
              "zero_optimization.reduce_bucket_size": hidden * hidden or None,
              "zero_optimization.stage3_prefetch_bucket_size": facts.block_size or None,
              "zero_optimization.leaf_module.classes": list(facts.blocks) or None,
              "zero_optimization.stage3_param_persistence_threshold": persist,
              "zero_optimization.stage3_gather_16bit_weights_on_model_save": True,
              "zero_optimization.stage3_gather_fp16_weights_on_model_save": True}
    for path in sorted(auto_paths(ds), key=lambda p: _dotted(p) == "scheduler.params.warmup_max_lr"):  # lr first
        key = _dotted(path)
        if key == "scheduler.params.warmup_max_lr":
            _set(ds, path, ds["optimizer"].get("params", {}).get("lr", lr))
        elif key in values:
            _set(ds, path, values[key])
        else:
            continue
        said[key] = FILLED[key]
    _fill_batch(ds, replicas, said)
    return ds, said


def _fill_batch(ds: dict, replicas: int, said: dict):
    """The batch triple where the file leaves it open: what follows from the rest follows; with no global batch,
    SAMPLES_PER_REPLICA per replica, the micro batch found at start (the largest that runs) and accumulation
    making up the rest."""
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    given = {key: ds.get(key) for key in keys}
    for key in ("train_batch_size", "gradient_accumulation_steps"):
        if given[key] == AUTO:
            del ds[key]
            said[key] = FILLED[key]
    micro = ds.get("train_micro_batch_size_per_gpu")
    if micro in (AUTO, None) and not isinstance(ds.get("train_batch_size"), int):
        ds.pop("gradient_accumulation_steps", None)
        ds.update(train_micro_batch_size_per_gpu=AUTO, train_batch_size=SAMPLES_PER_REPLICA * replicas)
        why = "the file gives no" if micro is None else "\"auto\" with no"
        said["train_batch_size"] = (f"{why} global batch: the app's default, {SAMPLES_PER_REPLICA} samples per "
                                    f"data-parallel replica")
        said["train_micro_batch_size_per_gpu"] = FILLED["train_micro_batch_size_per_gpu"]
        written = given["gradient_accumulation_steps"]
        said["gradient_accumulation_steps"] = FILLED["gradient_accumulation_steps"] if written in (AUTO, None) else (
            f"the file's {written} set aside: beside micro batch \"auto\" the accumulation makes up the global batch "
            f"over the micro batch found")


def fill_lengths(ds: dict, total_steps: int, said: dict) -> dict:
    """The scheduler's "auto" lengths from the run's optimizer steps."""
    params = (ds.get("scheduler") or {}).get("params") or {}
    for key, value in (("warmup_num_steps", max(1, round(WARMUP_SHARE * total_steps))),
                       ("total_num_steps", total_steps)):
        if params.get(key) == AUTO:
            params[key] = value
            said[f"scheduler.params.{key}"] = FILLED[f"scheduler.params.{key}"]
    return ds


def _value(ds: dict, key: str):
    for part in key.split("."):
        ds = ds.get(part) if isinstance(ds, dict) else None
    return ds


def say(ds: dict, said: dict, output_dir: Path, main: bool) -> str:
    """The block rank 0 prints (key = value, and where it came from), written to output_dir/FILE as well."""
    if not said:
        return ""
    values = {key: _value(ds, key) for key in said}
    if main:
        (output_dir / FILE).write_text(json.dumps({k: {"value": values[k], "from": why} for k, why in said.items()},
                                                  indent=1) + "\n")
    rows = "\n".join(f"  {key} = {json.dumps(values[key])}  ({why})" for key, why in said.items())
    return f"filled in (saved in {FILE}):\n{rows}"
