"""The one place a run's task is picked: from the settings and, for a run, a look at its data (the rows' form says
instruction or preference); the tools, which bring their own data, pick from the settings alone."""
from pathlib import Path

import torch

from app.core import models
from app.core.grpo import Grpo
from app.core.preference import Preference
from app.core.task import Task
from app.core.tasks import CausalLM, ImageClassification, Instruction, SequenceClassification, image_data, text_data
from app.ds import auto as ds_auto
from app.errors import UserError
from app.settings import Settings

TEXT_TASKS = ("causal_lm", "instruction", "preference", "grpo", "sequence_classification")
CLASSES = {"causal_lm": CausalLM, "instruction": Instruction, "preference": Preference, "grpo": Grpo,
           "sequence_classification": SequenceClassification}


def spec_of(settings: Settings, run: bool = True):
    """The transformers model's HFSpec (None for an image model), once the flags are known to suit the model (run:
    a run's flags, not a tool's: GRPO's rewards too)."""
    spec = models.hf_spec(settings.model)
    if settings.task != "auto" and spec is None and settings.task in TEXT_TASKS:
        raise UserError(f"--task {settings.task} trains a transformers model on text; {settings.model} is an image "
                        f"model: pass a transformers model, or leave --task auto")
    if settings.task != "auto" and (spec is None or settings.task not in TEXT_TASKS):
        kinds = "transformers models" if spec is not None else "image models (leave --task auto)"
        raise UserError(f"--task {settings.task!r} is not one of auto, {', '.join(TEXT_TASKS)} for {kinds}")
    if spec is None:
        if settings.lora:
            raise UserError(f"--lora trains adapters on a transformers model (HF peft); {settings.model} is an image "
                            f"model: pass a transformers model folder, hub name or preset, or leave --lora out")
        if settings.streaming == "on":
            raise UserError(f"--streaming on streams text for a transformers model; {settings.model} is an image "
                            f"model: leave it off")
        if settings.packing == "on":
            raise UserError("--packing on packs the rows of instruction data for a transformers model; "
                            f"{settings.model} is an image model: leave --packing auto")
    elif asked(settings, spec) in ("preference", "grpo") and spec.task != "causal_lm":
        what = "pairs of answers" if settings.task == "preference" else "completions it samples"
        raise UserError(f"--task {settings.task} trains a causal language model on {what}; {settings.model} is a "
                        f"sequence classifier: pass a causal LM")
    elif asked(settings, spec) == "grpo":
        Grpo.check(settings, rewarded=run)
    if spec is not None and settings.model_weights:
        raise UserError(f"--model_weights starts a torchvision classifier from pretrained weights; a transformers "
                        f"model's come with --model (a save_pretrained folder or a hub name), not {settings.model}")
    if run and spec is not None and spec.pretrained and Path(spec.pretrained).is_dir():
        models.check_weights(spec.pretrained)
    return spec


def asked(settings: Settings, spec: models.HFSpec) -> str:
    """The task the flags ask for: --task, or the model's own."""
    return spec.task if settings.task == "auto" else settings.task


def build(settings: Settings) -> Task:
    """The task for the flags alone, without data (the tools: the benchmark, the plan)."""
    spec = spec_of(settings, run=False)
    return ImageClassification(settings) if spec is None else CLASSES[asked(settings, spec)](settings, spec)


def resolve(settings: Settings, spec, output_dir: Path) -> Task:
    """A run's task, holding its data: the rows read (and tokenized once, cached), then the task their form asks
    for (text rows of chats, prompts with completions, or pairs: instruction or preference tuning)."""
    if spec is None:
        return ImageClassification(settings, image_data(settings))
    data, tokenizer, kind = text_data(settings, spec, asked(settings, spec), output_dir)
    return CLASSES[kind](settings, spec, data, tokenizer)


def auto_facts(spec, device=None) -> ds_auto.Facts:
    """What "auto" values depend on besides the JSON: whether the model loads trained weights, its hidden size, its
    blocks (spec: the transformers model's HFSpec; None: an image model, none of these), and whether the ranks run
    on the CPU (device: this rank's; None: a GPU's, as app.tools.plan plans)."""
    cpu = device is not None and torch.device(device).type == "cpu"
    if spec is None:
        return ds_auto.Facts(cpu=cpu)
    config = spec.config
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or getattr(config, "d_model", 0)
    folder = Path(spec.pretrained) if spec.pretrained else None
    weights = bool(spec.pretrained) and not (folder.is_dir() and not any(
        any(folder.glob(pattern)) for pattern in models.WEIGHT_FILES))
    blocks, block_size = models.block_shape(spec)
    return ds_auto.Facts(pretrained=weights, hidden=int(hidden or 0), blocks=blocks, block_size=block_size, cpu=cpu)
