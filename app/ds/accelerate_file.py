"""An accelerate config file (the YAML `accelerate config` writes, and TRL's and others' examples ship) read as the
DeepSpeed JSON accelerate builds from it: its deepspeed_config section through accelerate's own DeepSpeedPlugin
(a deepspeed_config_file it names read as accelerate reads it), its mixed_precision set as accelerate sets it;
the file alone decides (accelerate's ACCELERATE_* variables set aside). offload_*_nvme_path, which
`accelerate launch` does not hand on, reach the JSON here. What is left "auto" (batch sizes, clipping) the run
fills as it fills any file's. The launch settings (num_processes, hostfile, ...) are the launcher's: the note says
so, and names the keys not read here."""
import contextlib
import difflib
import json
import math
import os
import warnings
from pathlib import Path

from app.errors import UserError, first_line
from app.redact import redacted

SUFFIXES = (".yaml", ".yml")
LAUNCH_KEYS = ("deepspeed_multinode_launcher", "deepspeed_hostfile", "deepspeed_exclusion_filter",
               "deepspeed_inclusion_filter")
"""Keys of a deepspeed_config section that `accelerate launch` reads, not DeepSpeed."""
PLUGIN_KEYS = {"gradient_accumulation_steps": "", "gradient_clipping": "", "zero_stage": "",
               "offload_optimizer_device": "", "offload_param_device": "", "offload_optimizer_nvme_path": "",
               "offload_param_nvme_path": "", "zero3_init_flag": "", "zero3_save_16bit_model": "",
               "deepspeed_config_file": "hf_ds_config"}
"""The section's keys `accelerate launch` hands DeepSpeedPlugin, and the field each fills where its name differs."""
NOT_WITH_A_FILE = ("gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device",
                   "offload_param_device", "offload_optimizer_nvme_path", "offload_param_nvme_path",
                   "zero3_save_16bit_model", "mixed_precision")
"""What accelerate refuses beside a deepspeed_config_file (the file sets it)."""
PRECISIONS = ("no", "fp16", "bf16")
NOT_HERE = {"tp_size": "tensor parallelism comes from the DeepSpeed JSON (ds_configs/tensor_parallel.json)",
            "cp_size": "context parallelism is not available here; sequence parallelism is (sp_size)",
            "dp_replicate_size": "replicated shards (HSDP) are not available here"}


def is_accelerate_file(path: Path) -> bool:
    return Path(path).suffix.lower() in SUFFIXES


def ds_config(path: Path, say) -> dict:
    """The DeepSpeed dict accelerate builds from the accelerate config file at path; one line where it holds
    something else or something accelerate refuses. say: how its note is printed."""
    top = _mapping(path)
    section = _section(path, top)
    fields, unread = {}, []
    for key, value in section.items():
        if key in PLUGIN_KEYS:
            fields[PLUGIN_KEYS[key] or key] = value
        elif key not in LAUNCH_KEYS:
            near = difflib.get_close_matches(key, PLUGIN_KEYS, n=1, cutoff=0.8)
            if near:
                raise UserError(f"{path}: deepspeed_config has {key!r}; did you mean {near[0]!r}?")
            unread.append(key)
    older_fp16 = ["fp16"] if "mixed_precision" not in top and top.get("fp16") else []  # accelerate's fp16 then
    clash = [key for key in NOT_WITH_A_FILE if key in {**top, **section}] + older_fp16 \
        if "hf_ds_config" in fields else []
    if clash:
        raise UserError(f"{path}: accelerate refuses {', '.join(clash)} beside a deepspeed_config_file; set "
                        f"{'it' if len(clash) == 1 else 'them'} in {fields['hf_ds_config']} instead")
    mixed = _precision(top)
    if mixed not in PRECISIONS:
        raise UserError(f"{path}: mixed_precision {mixed} is not one this app trains in; set it to bf16, fp16 or no")
    given = top.get("parallelism_config")
    parallel, unread_there = _parallelism(path, {} if given is None else given)
    ds = {**_built(path, fields, mixed), **parallel}
    if "zero3_init_flag" in section and bool(section["zero3_init_flag"]) != (ds["zero_optimization"]["stage"] == 3):
        unread.append("zero3_init_flag")  # a ZeRO-3 transformers model is built under zero.Init here, no other
    _say(path, top, section, ds, unread + unread_there, say)
    return ds


def _section(path: Path, top: dict) -> dict:
    """The file's deepspeed_config section; one line where the file is not an accelerate config for DeepSpeed."""
    kind = str(top.get("distributed_type", "none")).split(".")[-1].upper()
    section = top.get("deepspeed_config")
    if kind != "DEEPSPEED" or not isinstance(section, dict):
        why = f"distributed_type {kind}" if kind != "DEEPSPEED" else "no deepspeed_config section"
        raise UserError(f"{path} is not an accelerate config for DeepSpeed ({why}): pass a DeepSpeed JSON file "
                        f"or one with distributed_type: DEEPSPEED (ds_configs/ has a JSON for each ZeRO stage)")
    return section


def _precision(top: dict) -> str:
    """The file's mixed_precision; where it has none, fp16 if it has the older `fp16: true`, as accelerate reads
    such a file."""
    if "mixed_precision" not in top:
        return "fp16" if top.get("fp16") else "no"
    return str(top["mixed_precision"] or "no").lower()


def _say(path: Path, top: dict, section: dict, ds: dict, unread: list, say):
    """The note: the JSON the file became, its launch settings, the keys not read here."""
    launch = {key: value for key, value in {**top, **section}.items() if key in ("num_processes", "num_machines",
                                                                                  *LAUNCH_KEYS)}
    said = ", ".join(f"{key}: {value}" for key, value in launch.items())
    backend = _dynamo_backend(top)
    say(f"note: {path} is an accelerate config, read as the DeepSpeed JSON accelerate builds from it: "
        f"{json.dumps(redacted(ds))}" + (f"; its launch settings ({said}) are the launcher's to take" if said else "")
        + (f"; its dynamo_backend {backend} is --compile's here (auto: on a GPU, off on a CPU)"
           if backend != "NO" else "")
        + (f"; not read here: {', '.join(unread)}" if unread else ""))


def _dynamo_backend(top: dict) -> str:
    """The torch.compile backend the file asks accelerate for: an older file's top-level dynamo_backend, which
    accelerate puts in dynamo_config's place, else dynamo_config's; NO for none."""
    config = top.get("dynamo_config")
    older = "dynamo_backend" in top or not isinstance(config, dict)
    backend = top.get("dynamo_backend") if older else config.get("dynamo_backend")
    return str(backend or "NO").split(".")[-1].upper()


def _parallelism(path: Path, config: dict) -> tuple:
    """(the DeepSpeed keys of the file's parallelism_config: sequence parallelism through DeepSpeed's Ulysses, as
    accelerate runs it; its keys not read here); one line for what is not available here."""
    if not isinstance(config, dict):
        raise UserError(f"{path}: parallelism_config {config!r} is not a mapping: write its sizes under it, such as "
                        f"parallelism_config_sp_size: 2")
    sizes = {str(key).removeprefix("parallelism_config_"): value for key, value in config.items()}
    for name, why in NOT_HERE.items():
        if _size(path, sizes, name) > 1:
            raise UserError(f"{path}: parallelism_config_{name} {sizes[name]}: {why}")
    sp = _size(path, sizes, "sp_size")
    if sp > 1 and str(sizes.get("sp_backend") or "deepspeed") != "deepspeed":
        raise UserError(f"{path}: parallelism_config_sp_backend {sizes['sp_backend']}: sequence parallelism here "
                        f"is DeepSpeed's Ulysses; set it to deepspeed")
    unread = [f"parallelism_config_{name}" for name in sizes if name not in ("sp_size", "sp_backend", *NOT_HERE)]
    return ({"sequence_parallel_size": sp} if sp > 1 else {}), unread


def _size(path: Path, sizes: dict, name: str) -> int:
    """The parallelism_config size called name, one this app reads (1 where unset); one line where it is not a
    whole number of at least 1, as accelerate refuses such a size."""
    value = sizes.get(name)
    if value is None or value == "":
        return 1
    if isinstance(value, bool) or not str(value).strip().isdecimal() or int(value) < 1:
        raise UserError(f"{path}: parallelism_config_{name} {value!r} is not a size: write a whole number of at "
                        f"least 1, such as 2")
    return int(value)


def config_text(path: Path) -> str:
    """The text of a config file, JSON or YAML; one line where it is not text."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path} is not a text file (not UTF-8): pass the DeepSpeed JSON file") from None


def _mapping(path: Path) -> dict:
    """The YAML mapping at path."""
    import yaml  # here: only a run given such a file needs it
    text = config_text(path)
    try:
        top = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise UserError(f"{path} is not valid YAML: {first_line(e)}") from None
    if not isinstance(top, dict):
        raise UserError(f"{path} must hold a YAML mapping at the top level, as an accelerate config does")
    return top


def _built(path: Path, fields: dict, mixed: str) -> dict:
    """accelerate's DeepSpeed dict of the section's fields and mixed precision (its steps_per_print, infinite,
    left out: not JSON)."""
    from accelerate.utils import DeepSpeedPlugin  # here: a run given a JSON file needs no accelerate
    named = fields.pop("hf_ds_config", None)
    if named is not None:
        found = next((p for p in (Path(named), path.parent / named) if p.is_file()), None)
        if found is None:
            raise UserError(f"{path}: its deepspeed_config_file {named} is not found (looked in the working folder "
                            f"and beside {path.name})")
        fields["hf_ds_config"] = str(found)
    try:
        with warnings.catch_warnings(), _file_alone():
            warnings.simplefilter("ignore")  # its warning on zero3_init_flag beside stage 2: the note says it
            plugin = DeepSpeedPlugin(**fields)
            plugin.set_mixed_precision(mixed)
    except (ValueError, TypeError, OSError) as e:
        raise UserError(f"{path}: accelerate refuses its DeepSpeed settings: {first_line(e)}") from None
    return {key: value for key, value in plugin.deepspeed_config.items()
            if not (isinstance(value, float) and math.isinf(value))}


@contextlib.contextmanager
def _file_alone():
    """accelerate's variables (ACCELERATE_*, PARALLELISM_CONFIG_*), which DeepSpeedPlugin reads where the file is
    silent, set aside while it builds."""
    aside = {key: os.environ.pop(key) for key in list(os.environ) if key.startswith(("ACCELERATE_",
                                                                                   "PARALLELISM_CONFIG_"))}
    try:
        yield
    finally:
        os.environ.update(aside)
