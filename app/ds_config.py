"""The DeepSpeed JSON: loaded once, checked strictly against DeepSpeed's own parser, "auto" precision resolved
from the device, batch sizes fitted to the real world size."""
import copy
import difflib
import json
from pathlib import Path

from app import activations, ds_internals
from app.errors import UserError

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DS_CONFIG = REPO / "ds_configs" / "dp.json"
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
MICRO = "train_micro_batch_size_per_gpu"
# Schedulers whose length DeepSpeed needs up front; the app fills it from the run's step count.
SCHEDULERS_WITH_TOTAL = ("WarmupDecayLR", "WarmupCosineLR")


def load_ds_config(path, cuda=None, bf16_ok=None, resolve: bool = True) -> dict:
    """Read a DeepSpeed JSON file, resolve "auto" precision for this machine (cuda: whether it trains on a
    CUDA device, bf16_ok: whether that device has bf16; default: the current device), and refuse anything
    DeepSpeed would silently ignore. resolve=False leaves "auto" precision to resolve_precision once the rank's
    device is set (the training run: asking before would open a CUDA context on GPU 0 in every rank)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"DeepSpeed config {path} not found; pass --deepspeed_config with one of "
                        f"{', '.join(sorted(p.name for p in (REPO / 'ds_configs').glob('*.json')))} in ds_configs/")
    try:
        ds = json.loads(path.read_bytes().decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except UnicodeDecodeError:
        raise UserError(f"{path} is not a text file (not UTF-8): pass the DeepSpeed JSON file") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except ValueError as e:
        raise UserError(f"{path}: {e}") from None
    if not isinstance(ds, dict):
        raise UserError(f"{path} must hold a JSON object at the top level")
    resolved, _ = resolve_precision(ds, str(path), cuda, bf16_ok) if resolve else \
        resolve_precision(ds, str(path), cuda=False)  # checked as on a CPU: the same keys
    check_value_types(resolved, str(path))
    activations.check(resolved, str(path))
    check_ds_keys(resolved, str(path))
    return resolved if resolve else ds


# Sections that switch a lower precision on, in the order "auto" prefers them. torch_autocast keeps fp32 weights
# and runs the forward in bf16 under torch.autocast (the recipe of plain PyTorch at its best); DeepSpeed's bf16
# and fp16 sections keep 16-bit weights behind an optimizer wrapper (README "Precision").
PRECISIONS = ("torch_autocast", "bf16", "fp16")
DTYPE_NAMES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16"}


def _label(ds: dict, name: str) -> str:
    """What a precision section computes in: 'bf16 autocast', 'bf16' or 'fp16'."""
    if name != "torch_autocast":
        return name
    return f"{DTYPE_NAMES.get(str(ds[name].get('dtype', 'bfloat16')).replace('torch.', ''), 'bf16')} autocast"


def bf16_runs(capability: tuple) -> bool:
    """Whether a CUDA device of this compute capability runs bf16 natively: Ampere (8.0) and later. Older GPUs
    (V100 7.0, T4 7.5) emulate it, slower than fp16, which torch.cuda.is_bf16_supported() counts as support."""
    return tuple(capability) >= (8, 0)


def resolve_precision(ds: dict, where: str, cuda=None, bf16_ok=None, device=None) -> tuple:
    """(ds with "enabled": "auto" made true or false, a note on what was picked and why).

    auto picks the first section in PRECISIONS order that the device can run: bf16 (autocast or weights) on a
    CUDA device that runs it natively, fp16 on one that does not, and fp32 on CPU, where bf16 matmuls are slower
    than fp32 and fp16 has no kernels. A section set to true wins over every "auto". The device is `device`
    (the rank's own, once set), else the current CUDA device; its compute capability is read without
    allocating on it.
    """
    import torch
    if device is not None:
        cuda = device.type == "cuda"
        bf16_ok = cuda and bf16_runs(torch.cuda.get_device_capability(device)) if bf16_ok is None else bf16_ok
    sections = [name for name in PRECISIONS if isinstance(ds.get(name), dict)]
    for name in sections:
        enabled = ds[name].get("enabled", False)
        if not isinstance(enabled, bool) and enabled != "auto":
            raise UserError(f"{where}: {name}.enabled must be true, false or \"auto\", got {enabled!r}")
    autos = [name for name in sections if ds[name].get("enabled") == "auto"]
    if not autos:
        return ds, ""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    bf16_ok = cuda and (bf16_runs(torch.cuda.get_device_capability()) if bf16_ok is None else bf16_ok)
    runs = {"bf16": bf16_ok, "fp16": cuda}
    fixed = [name for name in sections if ds[name].get("enabled") is True]
    pick = fixed[0] if fixed else next((name for name in autos if runs[_label(ds, name).split()[0]]), "")
    ds = copy.deepcopy(ds)
    for name in autos:
        ds[name]["enabled"] = name == pick
        if name == pick == "torch_autocast":
            ds[name].setdefault("dtype", "bfloat16")
    why = "no CUDA device" if not cuda else "the CUDA device supports bf16" if bf16_ok else \
        "the CUDA device has no native bf16"
    return ds, f"{_label(ds, pick) if pick else 'fp32'} ({'/'.join(autos)} \"auto\": {why})"


def _no_duplicate_keys(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"key {key!r} appears twice")
        seen[key] = value
    return seen


def check_ds_keys(ds: dict, where: str):
    """Fail on keys DeepSpeed does not know, at the top level and inside sections."""
    from pydantic import ValidationError
    auto = _check_auto_micro(ds, where)
    for key in BATCH_KEYS:
        value = ds.get(key)
        if value is not None and not (auto and key == MICRO) and \
                (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise UserError(f"{where}: {key} must be a positive integer, got {value!r}")
    if MICRO not in ds and "train_batch_size" not in ds:
        raise UserError(f"{where}: set train_micro_batch_size_per_gpu (and gradient_accumulation_steps)")
    # DeepSpeed's parser needs numbers: a micro batch "auto" is checked as one global batch of micro batches of 1
    recorder = ds_internals.Recorder({**copy.deepcopy(ds), **({MICRO: 1, "gradient_accumulation_steps":
                                                               ds["train_batch_size"]} if auto else {})})
    user_keys = {k: set(v) if isinstance(v, dict) else None for k, v in ds.items()}
    try:
        ds_internals.parse_config(recorder)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        section = _section_of(ds, err["loc"][0]) or e.title
        given = f", got {err['input']!r}" if err["type"] != "extra_forbidden" and "input" in err else ""
        raise UserError(f"{where}: {section}.{loc}: {err['msg'].lower()}{given}{_suggest(err['loc'][-1], e)}") \
            from None
    except Exception as e:  # DeepSpeed's own config errors are plain exceptions with a sentence
        raise UserError(f"{where}: DeepSpeed rejected the config: {str(e).splitlines()[0]}") from None
    known_top = recorder.read | set(BATCH_KEYS)
    for key in ds:
        if key not in known_top:
            raise UserError(f"{where}: unknown DeepSpeed key {key!r}{suggest(key, known_top)}")
    for key, sub in user_keys.items():
        section = dict.__getitem__(recorder, key)
        # Sections read key by key have a record; sections handed whole to pydantic were checked there.
        if sub and isinstance(section, ds_internals.Recorder) and section.read and not _pydantic_checked(ds, key):
            for sub_key in sub:
                if sub_key not in section.read:
                    raise UserError(f"{where}: unknown key {key}.{sub_key}{suggest(sub_key, section.read)}")


# Top-level keys DeepSpeed gives no typed default for, but reads as numbers.
NUMBERS = {"steps_per_print": int}


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _numeric_text(value) -> bool:
    try:
        float(value)
        return isinstance(value, str)
    except (TypeError, ValueError):
        return False


def check_value_types(ds: dict, where: str):
    """Name the key whose value has the wrong type: DeepSpeed reads top-level settings and optimizer and
    scheduler parameters without checking them, and fails later with a comparison error that names none."""
    defaults = ds_internals.scalar_defaults()
    for key, value in ds.items():
        expected = NUMBERS.get(key) or type(defaults.get(key))
        wrong = (expected is bool and not isinstance(value, bool)) or \
            (expected in (int, float) and not _number(value)) or (expected is int and isinstance(value, float))
        if key in BATCH_KEYS or not wrong:
            continue
        kind = {bool: "true or false", int: "a whole number", float: "a number"}.get(expected, expected.__name__)
        raise UserError(f"{where}: {key} must be {kind}, got {value!r}" +
                        (" (a string: drop the quotes)" if _numeric_text(value) else ""))
    for section in ("optimizer", "scheduler"):
        params = (ds.get(section) or {}).get("params") or {}
        for key, value in params.items() if isinstance(params, dict) else ():
            if _numeric_text(value) or (isinstance(value, list) and any(_numeric_text(v) for v in value)):
                raise UserError(f"{where}: {section}.params.{key} must be a number, got {value!r} (a string: "
                                f"drop the quotes)")


def _check_auto_micro(ds: dict, where: str) -> bool:
    """Whether the micro batch is "auto" (found at start, app/autobatch.py); one line for what cannot go with it."""
    if ds.get(MICRO) != "auto":
        return False
    if not isinstance(ds.get("train_batch_size"), int) or isinstance(ds.get("train_batch_size"), bool):
        raise UserError(f"{where}: train_micro_batch_size_per_gpu \"auto\" finds the largest micro batch that fits "
                        f"and keeps the global batch: set train_batch_size to that global batch")
    if "gradient_accumulation_steps" in ds:
        raise UserError(f"{where}: with train_micro_batch_size_per_gpu \"auto\", gradient_accumulation_steps follows "
                        f"from the micro batch found (train_batch_size / micro batch / data-parallel ranks): drop it")
    return True


def _pydantic_checked(ds, key) -> bool:
    """True when DeepSpeed validates section `key` with a model that forbids unknown fields."""
    from pydantic import ValidationError
    probe = copy.deepcopy(ds)
    probe[key]["__probe__"] = 0
    try:
        ds_internals.parse_config(probe)
    except ValidationError as e:
        return "__probe__" in str(e)
    except Exception:
        return False
    return False


def _section_of(ds, first):
    for key, value in ds.items():
        if isinstance(value, dict) and (first in value or key == first):
            return key
    return None


def suggest(key, known):
    match = difflib.get_close_matches(key, sorted(known), n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _suggest(key, error):
    known = ds_internals.section_fields(getattr(error, "title", ""))
    return suggest(str(key), known) if known and str(key) not in known else ""


def resolve_batch_sizes(ds: dict, world_size: int, where: str) -> dict:
    """Fill in the batch triple for this world size, or explain which numbers cannot agree. A micro batch "auto"
    stays so (app/autobatch.py finds it), once the global batch is known to split over the world size."""
    ds = copy.deepcopy(ds)
    total, micro = ds.get("train_batch_size"), ds.get("train_micro_batch_size_per_gpu")
    if micro == "auto":
        if total % world_size:
            raise UserError(f"{where}: train_batch_size {total} cannot be split over {world_size} data-parallel "
                            f"rank(s): no micro batch makes it; make it a multiple of {world_size}")
        return ds
    accum = ds.get("gradient_accumulation_steps")
    if micro is None:
        accum = accum or 1
        if total % (accum * world_size):
            raise UserError(f"{where}: train_batch_size {total} is not divisible by gradient_accumulation_steps "
                            f"{accum} x world size {world_size}; set train_micro_batch_size_per_gpu instead")
        micro = total // (accum * world_size)
    elif accum is None:
        accum = 1 if total is None else total // (micro * world_size)
        if total is not None and (accum < 1 or accum * micro * world_size != total):
            raise UserError(f"{where}: train_batch_size {total} cannot be split into micro batches of {micro} on "
                            f"{world_size} ranks; drop train_batch_size or make it a multiple of {micro * world_size}")
    if total is not None and total != micro * accum * world_size:
        raise UserError(
            f"{where}: train_batch_size {total} != train_micro_batch_size_per_gpu {micro} x "
            f"gradient_accumulation_steps {accum} x world size {world_size} = {micro * accum * world_size}; "
            f"remove train_batch_size so it follows the world size")
    ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"] = micro, accum
    ds["train_batch_size"] = micro * accum * world_size
    return ds


REDUCE_BUCKET = int(5e8)  # DeepSpeed's reduce_bucket_size when the JSON sets none, in elements


def fit_buckets(ds: dict, trainable: int) -> dict:
    """ds with ZeRO's reduce bucket no larger than the model's trainable parameters where the JSON leaves it unset:
    DeepSpeed allocates whole buckets (5e8 elements: 2 GB in fp32, per gradient dtype) whatever the model holds."""
    zero = ds.get("zero_optimization") or {}
    if zero_stage(ds) == 0 or "reduce_bucket_size" in zero:
        return ds
    return {**ds, "zero_optimization": {**zero, "reduce_bucket_size": min(REDUCE_BUCKET, max(1, trainable))}}


def zero_stage(ds: dict) -> int:
    """The ZeRO stage a DeepSpeed dict asks for (0 when it names none)."""
    return int((ds.get("zero_optimization") or {}).get("stage", 0))


def fill_scheduler_length(ds: dict, total_steps: int) -> dict:
    """Give schedulers that need a length the run's own step count, unless the JSON sets one."""
    scheduler = ds.get("scheduler")
    if isinstance(scheduler, dict) and scheduler.get("type") in SCHEDULERS_WITH_TOTAL:
        params = scheduler.setdefault("params", {})
        params.setdefault("total_num_steps", total_steps)
    return ds
