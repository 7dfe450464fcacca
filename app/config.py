"""App settings, argument parsing, and strict loading of the DeepSpeed JSON."""
import argparse
import copy
import difflib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from app.errors import UserError

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DS_CONFIG = REPO / "ds_configs" / "dp.json"
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# Schedulers whose length DeepSpeed needs up front; the app fills it from the run's step count.
SCHEDULERS_WITH_TOTAL = ("WarmupDecayLR", "WarmupCosineLR")


@dataclass
class Settings:
    """What the app itself owns; everything about optimisation lives in the DeepSpeed JSON."""
    model: str = "cnn"
    """cnn, mlp, a torchvision classifier (resnet18, ...), a transformers preset (gpt2-tiny, gpt2-124m, bert-tiny),
    a save_pretrained folder, or a hub model name."""
    dataset: str = "digits"
    """Images: digits, synthetic, mnist, fashion_mnist, cifar10, imagefolder. Text (transformers models): a
    .txt/.json/.jsonl/.csv/.parquet file or a folder of them, or a hub dataset name."""
    task: str = "auto"
    """Text: causal_lm or sequence_classification; auto takes the model's own (presets: gpt2-* causal_lm,
    bert-tiny sequence_classification; folders and hub models: the architecture in their config)."""
    tokenizer: str = ""
    """Text: '' uses the model folder's tokenizer, else a byte-level one built locally; 'bytes'; 'bpe' (trained on
    the data up to the model's vocabulary); or a tokenizer folder or hub name. Saved in output_dir/tokenizer."""
    block_size: int = 0
    """Text: tokens per language-model block, or the length rows are cut to for classification (0: the model's
    positions, at most 1024)."""
    text_column: str = ""
    """Text: the column holding the text (default: 'text', or the only string column)."""
    label_column: str = ""
    """Text classification: the column holding the label (default: 'label' or 'labels')."""
    dataset_config: str = ""
    """Text: the configuration name of a hub dataset (e.g. wikitext-2-raw-v1)."""
    eval_file: str = ""
    """Text: a file of held-out rows; otherwise the dataset's validation/test split, else --eval_fraction."""
    eval_fraction: float = 0.1
    """Text: share of the training rows held out when there is no --eval_file or validation split."""
    peak_flops: float = 0.0
    """FLOP/s one rank can reach, for model FLOP utilisation; 0 measures a matmul at start-up."""
    data_dir: str = "data"
    """Where torchvision datasets live (downloaded there when online) and ImageFolder reads."""
    image_size: int = 224
    """Side in pixels that ImageFolder images are resized and cropped to."""
    epochs: int = 10
    """Passes over the training set (ignored when max_steps is set)."""
    max_steps: int = 0
    """Optimizer steps to run, across epochs; 0 means train for --epochs."""
    eval_interval: int = 0
    """Evaluate every N optimizer steps; 0 means at the end of each epoch. Always at the end."""
    log_interval: int = 10
    """Write a metrics row (and a log line) every N optimizer steps."""
    output_dir: str = ""
    """Directory for metrics, plots and TensorBoard files; default runs/<dataset>-<model>-<time>."""
    overwrite: bool = False
    """Allow writing into an output_dir that already holds a run."""
    save_interval: int = 0
    """Save a checkpoint every N optimizer steps (0: only at the end, which always saves)."""
    keep_last: int = 3
    """Keep the newest K complete checkpoints (0 keeps all)."""
    resume: str = ""
    """'auto': continue from the newest complete checkpoint in output_dir (fresh if none); or a checkpoint path."""
    seed: int = 42
    """Seed for model initialisation and data order (identical on every rank)."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""
    pin_memory: bool = False
    """Pin host memory in the DataLoader (useful on CUDA only)."""
    single_process: bool = False
    """Without a launcher, stay in one process even when several GPUs are present."""
    grace_period: int = 60
    """Seconds a SIGTERM/SIGINT'd run may take to finish its step and save before it is ended."""
    dist_timeout: int = 600
    """Seconds a collective may wait before the run fails instead of hanging."""
    compile: str = "auto"
    """torch.compile the model and its loss through engine.compile: on, off, or auto (on with a CUDA device,
    off on CPU, where the compile time is not won back; README "Compile")."""
    tf32: str = "on"
    """fp32 runs on CUDA: 'on' lets matmuls and convolutions use TF32 tensor cores, 'off' keeps full fp32."""
    deepspeed_config: str = str(DEFAULT_DS_CONFIG)
    """Path of the DeepSpeed JSON file."""

    def __post_init__(self):
        for name in ("epochs", "log_interval", "dist_timeout", "image_size", "grace_period"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_steps", "eval_interval", "num_workers", "save_interval", "keep_last", "block_size",
                     "peak_flops"):
            if getattr(self, name) < 0:
                raise UserError(f"--{name} must be 0 or more, got {getattr(self, name)}")
        for name, allowed in (("compile", ("auto", "on", "off")), ("tf32", ("on", "off"))):
            if getattr(self, name) not in allowed:
                raise UserError(f"--{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if not 0 < self.eval_fraction < 1:
            raise UserError(f"--eval_fraction must be between 0 and 1, got {self.eval_fraction}")


def _field_help():
    """One help line per Settings field, taken from the docstring under it."""
    import ast
    import inspect
    tree = ast.parse(inspect.getsource(Settings))
    body = tree.body[0].body
    helps = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            helps[node.target.id] = nxt.value.value
    return helps


def build_parser() -> argparse.ArgumentParser:
    """The command line: one flag per Settings field plus DeepSpeed's own arguments."""
    import deepspeed
    parser = argparse.ArgumentParser(
        prog="train.py",
        description="Train a PyTorch model through DeepSpeed. The JSON given by --deepspeed_config "
                    "owns optimizer, scheduler, precision, ZeRO and batch sizes; these flags own the rest.")
    helps = _field_help()
    for f in fields(Settings):
        if f.name == "deepspeed_config":
            continue
        flag = f"--{f.name}"
        if f.type is bool or isinstance(f.default, bool):
            parser.add_argument(flag, action="store_true", help=helps[f.name])
        else:
            kind = type(f.default)
            parser.add_argument(flag, type=kind, default=f.default, help=f"{helps[f.name]} (default: {f.default!r})")
    parser.add_argument("--local_rank", type=int, default=-1,
                        help="Set by the deepspeed launcher; the app reads LOCAL_RANK itself.")
    deepspeed.add_config_arguments(parser)
    return parser


def parse(argv=None):
    """Parse argv into Settings and a checked DeepSpeed dict (world size not applied yet)."""
    args = build_parser().parse_args(argv)
    values = {f.name: getattr(args, f.name) for f in fields(Settings) if f.name != "deepspeed_config"}
    values["deepspeed_config"] = args.deepspeed_config or str(DEFAULT_DS_CONFIG)
    settings = Settings(**values)
    return settings, load_ds_config(settings.deepspeed_config)


def load_ds_config(path, cuda=None) -> dict:
    """Read a DeepSpeed JSON file, resolve "auto" precision for this machine (cuda: whether it trains on a
    CUDA device; default: whether one is visible), and refuse anything DeepSpeed would silently ignore."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"DeepSpeed config {path} not found; pass --deepspeed_config with one of "
                        f"{', '.join(sorted(p.name for p in (REPO / 'ds_configs').glob('*.json')))} in ds_configs/")
    try:
        ds = json.loads(path.read_text(), object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except ValueError as e:
        raise UserError(f"{path}: {e}") from None
    if not isinstance(ds, dict):
        raise UserError(f"{path} must hold a JSON object at the top level")
    ds, _ = resolve_precision(ds, str(path), cuda)
    check_ds_keys(ds, str(path))
    return ds


PRECISIONS = ("bf16", "fp16")


def resolve_precision(ds: dict, where: str, cuda=None, bf16_ok=None) -> tuple:
    """(ds with "enabled": "auto" made true or false, a note on what was picked and why).

    auto picks bf16 on a CUDA device that supports it, fp16 on one that does not (when fp16 is
    "auto"), and fp32 on CPU, where bf16 matmuls are slower than fp32 and fp16 has no kernels.
    """
    import torch
    autos = [name for name in PRECISIONS if isinstance(ds.get(name), dict) and ds[name].get("enabled") == "auto"]
    for name in PRECISIONS:
        enabled = ds.get(name, {}).get("enabled", False) if isinstance(ds.get(name), dict) else False
        if not isinstance(enabled, bool) and enabled != "auto":
            raise UserError(f"{where}: {name}.enabled must be true, false or \"auto\", got {enabled!r}")
    if not autos:
        return ds, ""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    bf16_ok = cuda and (torch.cuda.is_bf16_supported() if bf16_ok is None else bf16_ok)
    pick = ("bf16" if "bf16" in autos and bf16_ok else "fp16" if "fp16" in autos and cuda else "fp32")
    if any(ds.get(name, {}).get("enabled") is True for name in PRECISIONS):
        pick = next(name for name in PRECISIONS if ds.get(name, {}).get("enabled") is True)
    ds = copy.deepcopy(ds)
    for name in autos:
        ds[name]["enabled"] = name == pick
    why = "no CUDA device" if not cuda else "the CUDA device supports bf16" if bf16_ok else \
        "the CUDA device has no bf16"
    return ds, f"{pick} ({'/'.join(autos)} \"auto\": {why})"


def precision_note(path) -> str:
    """What "auto" precision in the JSON at path resolved to on this machine, or '' when it names none."""
    ds = json.loads(Path(path).read_text())
    return resolve_precision(ds, str(path))[1]


def _no_duplicate_keys(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"key {key!r} appears twice")
        seen[key] = value
    return seen


class _Recorder(dict):
    """A dict that remembers which keys DeepSpeed's config parser looked at."""

    def __init__(self, data):
        super().__init__({k: _Recorder(v) if isinstance(v, dict) else v for k, v in data.items()})
        self.read = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)


def _deepspeed_parse(ds: dict):
    """Run DeepSpeed's own config parser on ds (a copy), batch sizes made consistent for one rank."""
    from deepspeed.runtime.config import DeepSpeedConfig
    micro, accum = ds.get("train_micro_batch_size_per_gpu"), ds.get("gradient_accumulation_steps", 1)
    if isinstance(micro, int) and isinstance(accum, int):
        dict.__setitem__(ds, "train_batch_size", micro * accum)
    return DeepSpeedConfig(ds)


def check_ds_keys(ds: dict, where: str):
    """Fail on keys DeepSpeed does not know, at the top level and inside sections."""
    from pydantic import ValidationError
    for key in BATCH_KEYS:
        value = ds.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise UserError(f"{where}: {key} must be a positive integer, got {value!r}")
    if "train_micro_batch_size_per_gpu" not in ds and "train_batch_size" not in ds:
        raise UserError(f"{where}: set train_micro_batch_size_per_gpu (and gradient_accumulation_steps)")
    recorder = _Recorder(copy.deepcopy(ds))
    user_keys = {k: set(v) if isinstance(v, dict) else None for k, v in ds.items()}
    try:
        _deepspeed_parse(recorder)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        section = _section_of(ds, err["loc"][0]) or e.title
        raise UserError(f"{where}: {section}.{loc}: {err['msg'].lower()}{_suggest(err['loc'][-1], e)}") from None
    except Exception as e:  # DeepSpeed's own config errors are plain exceptions with a sentence
        raise UserError(f"{where}: DeepSpeed rejected the config: {str(e).splitlines()[0]}") from None
    known_top = recorder.read | set(BATCH_KEYS)
    for key in ds:
        if key not in known_top:
            raise UserError(f"{where}: unknown DeepSpeed key {key!r}{_close(key, known_top)}")
    for key, sub in user_keys.items():
        section = dict.__getitem__(recorder, key)
        # Sections read key by key have a record; sections handed whole to pydantic were checked there.
        if sub and isinstance(section, _Recorder) and section.read and not _pydantic_checked(ds, key):
            for sub_key in sub:
                if sub_key not in section.read:
                    raise UserError(f"{where}: unknown key {key}.{sub_key}{_close(sub_key, section.read)}")


def _pydantic_checked(ds, key) -> bool:
    """True when DeepSpeed validates section `key` with a model that forbids unknown fields."""
    from pydantic import ValidationError
    probe = copy.deepcopy(ds)
    probe[key]["__probe__"] = 0
    try:
        _deepspeed_parse(probe)
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


def _close(key, known):
    match = difflib.get_close_matches(key, sorted(known), n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _suggest(key, error):
    model = getattr(error, "title", "")
    try:
        import deepspeed.runtime.zero.config as zc
        import deepspeed.runtime.precision_config as pc
        known = {}
        for mod in (zc, pc):
            for cls in vars(mod).values():
                if getattr(cls, "__name__", None) == model and hasattr(cls, "model_fields"):
                    known = set(cls.model_fields)
        return _close(str(key), known) if known else ""
    except ImportError:
        return ""


def resolve_batch_sizes(ds: dict, world_size: int, where: str) -> dict:
    """Fill in the batch triple for this world size, or explain which numbers cannot agree."""
    ds = copy.deepcopy(ds)
    total, micro = ds.get("train_batch_size"), ds.get("train_micro_batch_size_per_gpu")
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


def settings_dict(settings: Settings) -> dict:
    """Settings as a plain dict, for the run's saved record."""
    return asdict(settings)
