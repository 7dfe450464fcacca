"""The DeepSpeed JSON: loaded once, checked strictly against DeepSpeed's own parser, "auto" precision resolved
from the device, batch sizes fitted to the real world size."""
import copy
import difflib
import json
from pathlib import Path

from app.ds import accelerate_file, older
from app.ds import auto as ds_auto
from app.ds import internals as ds_internals
from app.ds.precision import resolve_precision
from app.errors import UserError

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DS_CONFIG = REPO / "ds_configs" / "dp.json"
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
MICRO = "train_micro_batch_size_per_gpu"
# Schedulers whose length DeepSpeed needs up front; the app fills it from the run's step count.
SCHEDULERS_WITH_TOTAL = ("WarmupDecayLR", "WarmupCosineLR")


def load_ds_config(path, cuda=None, bf16_ok=None, resolve: bool = True, say=print) -> dict:
    """Read a DeepSpeed JSON file (or an accelerate config's: accelerate_file), resolve "auto" precision for this
    machine (cuda: whether it trains on a CUDA device, bf16_ok: whether that device has bf16; default: the current
    device), and refuse anything DeepSpeed would silently ignore. resolve=False leaves "auto" precision to
    resolve_precision once the rank's device is set (the training run: asking before would open a CUDA context on
    GPU 0 in every rank). say: how a warning or note is printed (a run passes its main rank's print)."""
    if not (path := Path(path)).is_file():
        raise UserError(f"DeepSpeed config {path} not found; pass --deepspeed_config with one of "
                        f"{', '.join(sorted(p.name for p in (REPO / 'ds_configs').glob('*.json')))} in ds_configs/")
    ds = accelerate_file.ds_config(path, say) if accelerate_file.is_accelerate_file(path) else _json_object(path)
    ds = older.today(without_comments(ds), str(path), say)  # before the checks, which today's keys pass
    resolved, _ = resolve_precision(ds, str(path), cuda, bf16_ok) if resolve else \
        resolve_precision(ds, str(path), cuda=False)  # checked as on a CPU: the same keys
    ds_auto.check(resolved, str(path))
    checked = ds_auto.stand_in(resolved)
    check_value_types(checked, str(path))
    _check_activation_checkpointing(checked, str(path))
    ignored = check_ds_keys(checked, str(path), say)
    return drop_keys(resolved if resolve else ds, ignored)


def _json_object(path: Path) -> dict:
    text = accelerate_file.config_text(path)
    try:
        ds = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except ValueError as e:  # a key twice
        raise UserError(f"{path}: {e}") from None
    if not isinstance(ds, dict):
        raise UserError(f"{path} must hold a JSON object at the top level")
    return ds


def without_comments(ds, top: bool = True):
    """ds without the keys that begin with '_' (`_comment`, `_doc`), at any depth: notes for people, which
    DeepSpeed never reads; and without top-level keys set to null, which DeepSpeed's defaults then fill (it
    would read a null section or number as a value and fail on it)."""
    if not isinstance(ds, dict):
        return ds
    return {key: without_comments(value, False) for key, value in ds.items()
            if not str(key).startswith("_") and not (top and value is None)}


def drop_keys(ds: dict, paths: list) -> dict:
    """ds without the (section, key) paths the check found DeepSpeed ignores."""
    ds = copy.deepcopy(ds)
    for path in paths:
        holder = ds
        for part in path[:-1]:
            holder = holder.get(part, {})
        holder.pop(path[-1], None)
    return ds


def _no_duplicate_keys(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"key {key!r} appears twice")
        seen[key] = value
    return seen


READ_WHEN_DISTRIBUTED = {"sequence_parallel_size"}
"""Keys DeepSpeed's config reads only inside a process group, where the parse above has none."""


def check_ds_keys(ds: dict, where: str, say=print) -> list:
    """Fail on a key DeepSpeed does not know that looks like one it does (a typo); the paths of the others, which
    DeepSpeed ignores, at the top level and inside sections."""
    from pydantic import ValidationError
    auto = _check_auto_micro(ds, where)
    for key in BATCH_KEYS:
        value = ds.get(key)
        if value is not None and not (auto and key == MICRO) and \
                (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise UserError(f"{where}: {key} must be a positive integer, got {value!r}")
    # DeepSpeed's parser needs numbers: a micro batch "auto" is checked as one global batch of micro batches of 1
    recorder = ds_internals.Recorder({**copy.deepcopy(ds), **({MICRO: 1, "gradient_accumulation_steps":
                                                               ds["train_batch_size"]} if auto else {})})
    user_keys = {k: set(v) if isinstance(v, dict) else None for k, v in ds.items()}
    try:
        ds_internals.parse_config(recorder)
    except ValidationError as e:
        err = e.errors()[0]
        if not err["loc"]:  # a check of the whole section (offload's ratio under ZeRO 1-2, fp16's loss scale)
            raise UserError(f"{where}: DeepSpeed rejected the config ({e.title}): {err['msg']}") from None
        loc = ".".join(str(p) for p in err["loc"])
        section = _section_of(ds, err["loc"][0]) or e.title
        given = f", got {err['input']!r}" if err["type"] != "extra_forbidden" and "input" in err else ""
        raise UserError(f"{where}: {section}.{loc}: {err['msg'].lower()}{given}{_suggest(err['loc'], e)}") \
            from None
    except Exception as e:  # DeepSpeed's own config errors are plain exceptions with a sentence
        raise UserError(f"{where}: DeepSpeed rejected the config: {str(e).splitlines()[0]}") from None
    known_top = recorder.read | set(BATCH_KEYS) | READ_WHEN_DISTRIBUTED
    ignored = [(key,) for key in ds if key not in known_top and _unknown(where, key, known_top, say)]
    for key, sub in user_keys.items():
        section = dict.__getitem__(recorder, key)
        # Sections read key by key have a record; sections handed whole to pydantic were checked there.
        if sub and isinstance(section, ds_internals.Recorder) and section.read and not _pydantic_checked(ds, key):
            known = section.read | READ_LATER.get(key, set())
            ignored += [(key, sub_key) for sub_key in sub
                        if sub_key not in known and _unknown(where, f"{key}.{sub_key}", known, say)]
    return ignored


def _unknown(where: str, key: str, known, say) -> bool:
    """A key DeepSpeed does not read: one line when it looks like a misspelling of one it does, else a warning
    that it is ignored, as DeepSpeed ignores it; True then."""
    name = key.rsplit(".", 1)[-1]
    close = suggest(name, known, cutoff=0.85)  # a letter or two off: 'comms_config' is no 'comms_logger'
    if close:
        raise UserError(f"{where}: unknown DeepSpeed key {key!r}{close}")
    say(f"warning: {where}: DeepSpeed does not read {key!r}; ignored")
    return True



ACTIVATION_CHECKPOINTING = "activation_checkpointing"


def _check_activation_checkpointing(ds: dict, where: str):
    """One line for a section the app cannot honour: not an object, or beside a pipeline (which checkpoints its
    layers itself). The section's options are weighed when it is applied (app/parallel/activations.py)."""
    section = ds.get(ACTIVATION_CHECKPOINTING)
    if section is None:
        return
    if not isinstance(section, dict):
        raise UserError(f"{where}: {ACTIVATION_CHECKPOINTING} must be an object, e.g. {{}} to checkpoint every "
                        f"model's blocks")
    if ds.get("pipeline"):
        raise UserError(f"{where}: a pipeline checkpoints its layers itself: set pipeline."
                        f"activation_checkpoint_interval and drop the {ACTIVATION_CHECKPOINTING} section")


# Keys of sections DeepSpeed reads when it builds the engine, not when it parses the config.
READ_LATER = {"optimizer": {"type", "params", "legacy_fusion"}, "scheduler": {"type", "params"}}
# Top-level keys DeepSpeed gives no typed default for, but reads as numbers.
NUMBERS = {"steps_per_print": int}
# Optimizer and scheduler parameters that are numbers (torch's optimizers, DeepSpeed's schedulers); others may be
# words (1-bit optimizers' comm_backend_name, warmup_type).
NUMERIC_PARAMS = {"lr", "betas", "eps", "weight_decay", "momentum", "warmup_min_lr", "warmup_max_lr",
                  "warmup_num_steps", "total_num_steps", "warmup_min_ratio", "cos_min_ratio", "last_batch_iteration",
                  "cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size"}


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _numeric_text(value) -> bool:
    try:
        return isinstance(value, str) and float(value) is not None
    except ValueError:
        return False


def check_value_types(ds: dict, where: str):
    """Name the key whose value has the wrong type: DeepSpeed reads top-level settings and optimizer and
    scheduler parameters without checking them, and fails later with a comparison error that names none."""
    defaults = ds_internals.scalar_defaults()
    for key, value in ds.items():
        expected = NUMBERS.get(key) or type(defaults.get(key))
        if expected is int and isinstance(value, float) and value.is_integer():
            ds[key] = value = int(value)  # 1e5 in JSON is a float; DeepSpeed wants the whole number it means
        wrong = (expected is bool and not isinstance(value, bool)) or \
            (expected in (int, float) and not _number(value)) or (expected is int and isinstance(value, float))
        if key in BATCH_KEYS or value is None or not wrong:
            continue
        kind = {bool: "true or false", int: "a whole number", float: "a number"}.get(expected, expected.__name__)
        raise UserError(f"{where}: {key} must be {kind}, got {value!r}" +
                        (" (a string: drop the quotes)" if _numeric_text(value) else ""))
    for section in ("optimizer", "scheduler"):
        params = (ds.get(section) or {}).get("params") or {}
        for key, value in params.items() if isinstance(params, dict) else ():
            texts = [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, str)]
            if texts and (key in NUMERIC_PARAMS or all(_numeric_text(v) for v in texts)):
                hint = " (a string: drop the quotes)" if all(_numeric_text(v) for v in texts) else ""
                raise UserError(f"{where}: {section}.params.{key} must be a number, got {value!r}{hint}")


def _check_auto_micro(ds: dict, where: str) -> bool:
    """Whether the micro batch is "auto" (found at start, app/memory/autobatch.py); one line for what cannot go with it."""
    if ds.get(MICRO) != "auto":  # beside a global batch: ds_auto gives one where the file has none
        return False
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
    except Exception as e:  # DeepSpeed's own errors are plain ones: not a section pydantic checks
        return isinstance(e, ValidationError) and "__probe__" in str(e)
    return False


def _section_of(ds, first):
    for key, value in ds.items():
        if isinstance(value, dict) and (first in value or key == first):
            return key
    return None


def suggest(key, known, cutoff: float = 0.6):
    match = difflib.get_close_matches(key, sorted(known), n=1, cutoff=cutoff)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _suggest(loc: tuple, error):
    """A close field name for the key at loc, from the DeepSpeed section (or the part of it) that refused it."""
    known = ds_internals.section_fields(getattr(error, "title", ""), loc[:-1])
    return suggest(str(loc[-1]), known) if known and str(loc[-1]) not in known else ""


def resolve_batch_sizes(ds: dict, world_size: int, where: str) -> dict:
    """Fill in the batch triple for this world size, or explain which numbers cannot agree. A micro batch "auto"
    stays so (app/memory/autobatch.py finds it), once the global batch is known to split over the world size."""
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
                            f"{accum} x data-parallel ranks {world_size}; set train_micro_batch_size_per_gpu instead")
        micro = total // (accum * world_size)
    elif accum is None:
        accum = 1 if total is None else total // (micro * world_size)
        if total is not None and (accum < 1 or accum * micro * world_size != total):
            raise UserError(f"{where}: train_batch_size {total} cannot be split into micro batches of {micro} on "
                            f"{world_size} data-parallel ranks; drop train_batch_size or make it a multiple of "
                            f"{micro * world_size}")
    if total is not None and total != micro * accum * world_size:
        raise UserError(f"{where}: train_batch_size {total} != train_micro_batch_size_per_gpu {micro} x "
                        f"gradient_accumulation_steps {accum} x data-parallel ranks {world_size} = "
                        f"{micro * accum * world_size}; remove train_batch_size so it follows the world size")
    ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"] = micro, accum
    ds["train_batch_size"] = micro * accum * world_size
    return ds


REDUCE_BUCKET = int(5e8)  # DeepSpeed's reduce_bucket_size when the JSON sets none, in elements


def buckets_within(ds: dict, trainable: int) -> dict:
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
