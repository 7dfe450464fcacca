"""LoRA: low-rank adapters (HF peft) on a transformers model, the base model frozen.

The model is wrapped before the engine is built, so only the adapters reach the optimizer and ZeRO-3 partitions
the wrapped model (the base was already built partitioned, one part per rank). Checkpoints hold the adapters and
the trainer state, not the frozen base: resume builds the base again from where it came from, and refuses a base
whose weights are not the ones the adapters were trained on. app/tools/export.py writes the adapter folder peft
loads, or the merged model.
"""
import contextlib
import hashlib
import warnings
from pathlib import Path

import torch

from app.errors import UserError

ALL_LINEAR = "all-linear"
ADAPTER_CONFIG = "adapter_config.json"  # peft's file names
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_TASKS = {"causal_lm": "CAUSAL_LM", "instruction": "CAUSAL_LM", "preference": "CAUSAL_LM", "grpo": "CAUSAL_LM",
              "sequence_classification": "SEQ_CLS"}
SAMPLED = 1 << 20  # bytes read from each end of a weight file for the base model's fingerprint


def targets_of(settings):
    """peft's target_modules for --lora_targets: 'all-linear', or the listed module names."""
    if settings.lora_targets.strip() == ALL_LINEAR:
        return ALL_LINEAR
    names = [name.strip() for name in settings.lora_targets.split(",") if name.strip()]
    if not names:
        raise UserError("--lora_targets is empty; pass all-linear or module names such as q_proj,v_proj")
    return names


def wrap(hf, settings, task: str):
    """The transformers model hf with LoRA adapters on its target modules; only they train."""
    from peft import LoraConfig, get_peft_model
    targets = targets_of(settings)
    if targets != ALL_LINEAR:
        _check_targets(hf, targets)
    config = LoraConfig(r=settings.lora_rank, lora_alpha=settings.lora_alpha, lora_dropout=settings.lora_dropout,
                        target_modules=targets, task_type=PEFT_TASKS[task])
    try:
        with quiet(), seeded(settings.seed):  # the same adapters whatever the ZeRO stage drew building the base
            wrapped = get_peft_model(hf, config)
    except ValueError as e:
        raise UserError(f"LoRA cannot wrap {type(hf).__name__}: {str(e).splitlines()[0]}; pick --lora_targets "
                        f"among its linear layers") from None
    # the frozen embeddings' output takes a gradient, so every block's input does: ZeRO-3 reduces a leaf block's
    # gradients in a full backward hook, which fires before the block's backward when no input needs a gradient
    hf.enable_input_require_grads()
    return wrapped


def _check_targets(hf, targets: list):
    """One line naming a target the model has no module of (peft's own error lists every module)."""
    names = [f".{name}" for name, _ in hf.named_modules()]  # peft's match: the whole name or its dotted end
    missing = [target for target in targets if not any(name.endswith(f".{target}") for name in names)]
    if missing:
        linear = sorted({name.rsplit(".", 1)[-1] for name, module in hf.named_modules()
                         if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"})
        raise UserError(f"--lora_targets: {type(hf).__name__} has no module named {', '.join(missing)}; its linear "
                        f"layers are {', '.join(linear)} (or pass all-linear)")


@contextlib.contextmanager
def quiet():
    """peft's warnings a user can do nothing about: a deprecated question it asks transformers, and GPT-2's Conv1D
    layers, whose fan_in_fan_out it sets itself."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message="fan_in_fan_out is set to False")
        yield


def adapter_sizes(hf, targets, rank: int) -> list:
    """The sizes of the adapters peft would add (A: rank x in, B: out x rank) to each target of hf, worked out from
    its shape alone (the memory plan's model is fake)."""
    out = hf.get_output_embeddings()
    sizes = []
    for name, module in hf.named_modules():
        linear = isinstance(module, torch.nn.Linear)
        if targets == ALL_LINEAR and module is out:  # all-linear leaves the output layer out, as peft does
            continue
        if targets != ALL_LINEAR and not any(f".{name}".endswith(f".{target}") for target in targets):
            continue
        if isinstance(module, torch.nn.Embedding) and targets != ALL_LINEAR:  # peft's lora_embedding_A and _B
            sizes += [rank * module.num_embeddings, module.embedding_dim * rank]
        elif linear or type(module).__name__ == "Conv1D":
            inputs, outputs = module.weight.shape[::-1] if linear else module.weight.shape  # Conv1D keeps (in, out)
            sizes += [rank * inputs, outputs * rank]
    return sizes


@contextlib.contextmanager
def seeded(seed: int):
    """Random numbers drawn inside come from seed alone, and those outside go on as if nothing was drawn."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def counts(model) -> tuple:
    """(parameters that train, all parameters), counted as ZeRO-3 would gather them."""
    sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]
    return sum(n for n, trains in sizes if trains), sum(n for n, _ in sizes)


def describe(model) -> str:
    """The start-up line of a LoRA run."""
    trained, total = counts(model)
    return (f"LoRA: {trained:,} adapter parameters train ({100 * trained / total:.2f}% of {total:,}); the base model "
            f"is frozen")


def save_config(hf, folder: Path):
    """The adapters' peft config (adapter_config.json), beside the config and tokenizer of a checkpoint."""
    hf.peft_config["default"].save_pretrained(str(folder))


def record(settings, spec) -> dict:
    """What a checkpoint records of LoRA: {} without it; else the adapters' settings and the base's fingerprint."""
    if not settings.lora:
        return {}
    targets = targets_of(settings)  # as peft takes them: "q_proj, v_proj" is "q_proj,v_proj"
    return {"rank": settings.lora_rank, "alpha": settings.lora_alpha, "dropout": settings.lora_dropout,
            "targets": targets if targets == ALL_LINEAR else ",".join(targets),
            "base": fingerprint(settings.model, spec.pretrained, settings.seed, spec.config)}


FLAGS = {"lora_rank": 8, "lora_alpha": 16.0, "lora_dropout": 0.0, "lora_targets": ALL_LINEAR}  # and their defaults


def check_flags(settings):
    """One line for LoRA's flags given without --lora: the run would train the whole model."""
    alone = [f"--{name}" for name, default in FLAGS.items() if getattr(settings, name) != default]
    if alone and not settings.lora:
        raise UserError(f"{', '.join(alone)} set the adapters of a LoRA run, and --lora is not given, so the whole "
                        f"model would train: add --lora, or leave {'them' if len(alone) > 1 else 'it'} out")


def check_layout(lora: bool, ranks):
    """LoRA trains under data parallel and ZeRO 0-3; one line for the model-parallel layouts."""
    if lora and (ranks.split or ranks.tensor > 1):
        raise UserError("LoRA runs under data parallel and ZeRO 0-3, not pipeline stages or tensor parallelism: "
                        "pick a ds_config without a pipeline or tensor_parallel section (zero3.json shards a large "
                        "base model)")


def fingerprint(model_name: str, pretrained: str, seed: int, config=None) -> str:
    """What identifies the frozen base model: its config and weight files (their sizes and both ends), a hub model's
    name and revision, or, for a model built from a preset's config, the preset and the seed that initialised it."""
    if not pretrained:
        return f"{model_name} initialised with seed {seed}"
    folder = Path(pretrained)
    if not folder.is_dir():  # a hub model: the snapshot transformers took it from, named by its revision
        from huggingface_hub import try_to_load_from_cache
        cached = try_to_load_from_cache(pretrained, "config.json")
        return f"{pretrained} (hub, revision {Path(cached).parent.name if isinstance(cached, str) else None})"
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for path in sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin")):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            digest.update(f.read(SAMPLED))
            f.seek(max(0, size - SAMPLED))
            digest.update(f.read(SAMPLED))
    return digest.hexdigest()


def write_adapters(hf_files: Path, state: dict, out: Path):
    """The adapter folder peft loads (PeftModel.from_pretrained(base, out)): adapter_config.json and the adapters'
    weights from a checkpoint's fp32 state dict, the base model built on the meta device (no memory for it)."""
    from peft import LoraConfig, PeftModel
    from transformers import AutoConfig
    from app.core.models import hf_class
    config = LoraConfig.from_pretrained(str(hf_files))
    task = "sequence_classification" if config.task_type == "SEQ_CLS" else "causal_lm"
    with torch.device("meta"), quiet():
        wrapped = PeftModel(hf_class(task).from_config(AutoConfig.from_pretrained(hf_files)), config)
    adapters = {name.removeprefix("hf."): tensor for name, tensor in state.items()}
    missing, unexpected = wrapped.load_state_dict(adapters, strict=False, assign=True)
    trained = {name for name, p in wrapped.named_parameters() if p.requires_grad}
    if unexpected or trained & set(missing):
        raise UserError(f"{hf_files.parent} does not match its adapter config (missing "
                        f"{sorted(trained & set(missing))[:3]}, unexpected {sorted(unexpected)[:3]})")
    wrapped.save_pretrained(str(out), save_embedding_layers=False)  # the base's vocabulary: never resized here


def merge(adapters: Path, base: str, task: str, out: Path, hf_files: Path):
    """A transformers folder of the base model with the adapters folded into its weights; the config is the run's
    (hf_files: its classes, its padding token), so a classifier's new head fits."""
    from peft import PeftModel
    from app.core.models import exported_config, hf_class
    model = hf_class(task).from_pretrained(base, config=exported_config(hf_files),
                                           ignore_mismatched_sizes=task == "sequence_classification")
    with quiet():
        merged = PeftModel.from_pretrained(model, str(adapters)).merge_and_unload()
    merged.save_pretrained(out)
