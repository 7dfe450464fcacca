"""One small object per kind of job: image classification, causal language modelling (on blocks of text, or on the
answers of instruction data), sequence classification.

Each builds its data and model and owns its loss, its metrics, its FLOPs per sample and the extra files its
checkpoints carry, so train.py and the loop call it without knowing which kind of job it is.
"""
import contextlib
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from app.distributed import dist
from app.core import lora, models, preference
from app.ds import auto as ds_auto
from app.settings import Settings
from app.data import DataInfo, TextModel
from app.data.chat import IGNORE
from app.errors import UserError

TEXT_TASKS = ("causal_lm", "instruction", "preference", "sequence_classification")


def class_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy of each sample, in fp32."""
    return F.cross_entropy(logits.float(), labels, reduction="none")


def class_correct(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """1.0 where the top class is the label, else 0.0."""
    return (logits.argmax(-1) == labels).float()


def _next_token(logits: torch.Tensor, labels: torch.Tensor):
    """Language-model logits as rows (batch x positions, vocab), each paired with the token it predicts, and
    how many tokens each sample predicts (labels of IGNORE, prompts and padding, are left out)."""
    rows, targets = logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1)
    return rows, targets, (labels[:, 1:] != IGNORE).sum(1).clamp(min=1)


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each sample's mean next-token cross entropy over the tokens it is labelled on, in fp32."""
    rows, targets, counted = _next_token(logits, labels)
    losses = F.cross_entropy(rows.float(), targets, reduction="none", ignore_index=IGNORE)
    return losses.view(len(logits), -1).sum(1) / counted


def next_token_correct(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each sample's share of the next tokens it is labelled on predicted right."""
    rows, targets, counted = _next_token(logits, labels)
    right = (rows.argmax(-1) == targets) & (targets != IGNORE)
    return right.view(len(logits), -1).sum(1) / counted


class ImageClassification:
    """A torchvision dataset or a built-in one, a built-in or torchvision classifier."""
    name = "image_classification"
    loss = staticmethod(class_loss)
    correct = staticmethod(class_correct)
    tokens_per_sample = 0
    bench_batch = 32
    """The global batch app.tools.bench uses unless told."""

    def __init__(self, settings: Settings):
        self.settings = settings

    def build_data(self, output_dir: Path) -> tuple:
        """(train set, eval set, DataInfo)."""
        from app.data.images import build_image_sets, unreadable_images
        with dist.main_process_first():  # rank 0 downloads, the others then read its files
            sets = build_image_sets(self.settings.dataset, self.settings.data_dir, self.settings.image_size)
        problem = dist.broadcast_object(unreadable_images(*sets[:2]) if dist.is_main() else "")  # before any write
        if problem:
            raise UserError(problem)
        return sets

    def sample_data(self, samples: int, seq_len: int) -> tuple:
        """(train set, DataInfo) for benchmarks, whatever the size asked: the digits for the built-in models,
        3x32x32 synthetic images for torchvision classifiers."""
        from app.data.images import build_image_sets
        return build_image_sets("digits" if self.settings.model in models.BUILTIN else "synthetic", "data")[::2]

    def build_model(self, info: DataInfo, ds_config: dict) -> nn.Module:
        return models.build_model(self.settings.model, info)

    def flops_per_sample(self, model: nn.Module, info: DataInfo) -> float:
        """Training FLOPs of one sample, counted on a forward and backward pass."""
        return models.counted_flops_per_sample(model, info)

    def eval_metrics(self, loss: float) -> dict:
        return {}

    def per_sample(self) -> dict:
        """What one sample holds besides itself, for the summary's rates: nothing."""
        return {}

    def save_files(self, folder: Path):
        """Extra files a checkpoint carries: none, the weights are the whole model."""


class TextTask:
    """What the transformers tasks share: text data through a tokenizer, the model from its HFSpec."""
    name = ""
    bench_batch = 16

    def __init__(self, settings: Settings, spec: models.HFSpec):
        self.settings, self.spec = settings, spec
        self.tokenizer, self.config, self.tokens_per_sample = None, None, 0
        self.train_set = self.eval_set = self.adapters = None

    def build_data(self, output_dir: Path) -> tuple:
        """(train set, eval set, DataInfo), tokenized once on the main rank and cached."""
        from app.data.images import BUILDERS
        from app.data.text_sets import build_text_sets
        if self.settings.dataset in BUILDERS:
            raise UserError(f"{self.settings.model} is a transformers model and trains on text, not "
                            f"{self.settings.dataset}; pass --dataset <.txt/.json/.jsonl/.csv/.parquet file or "
                            f"folder, or a hub dataset>")
        train_set, eval_set, info, self.tokenizer, self.name = build_text_sets(self.settings, self.text_model(),
                                                                               self.name, output_dir)
        self.tokens_per_sample, self.train_set, self.eval_set = info.seq_len, train_set, eval_set
        return train_set, eval_set, info

    def per_sample(self) -> dict:
        """Instruction data: the rows and real (not padding) tokens of a sample, on average; else nothing."""
        return self.train_set.per_sample() if hasattr(self.train_set, "per_sample") else {}

    def text_model(self) -> TextModel:
        return TextModel(self.spec.pretrained, models.vocab_size(self.spec.config), self.spec.max_positions)

    def build_model(self, info: DataInfo, ds_config: dict) -> nn.Module:
        """The transformers model as HFLogits; with --lora, its adapters on the frozen base (a preset's base
        initialised from --seed alone, so that a resumed run builds the same one)."""
        settings = self.settings
        with lora.seeded(settings.seed) if settings.lora and not self.spec.pretrained else contextlib.nullcontext():
            model = models.build_hf(self.spec, info, self.tokenizer, ds_config, settings.attention)
        self.config = model.hf.config  # not the model: a pipeline stage keeps only its own layers
        if settings.lora:
            model.hf = lora.wrap(model.hf, settings, self.name)
            self.adapters = model.hf.peft_config["default"]
        return model

    def flops_per_sample(self, model: nn.Module, info: DataInfo) -> float:
        """Training FLOPs of one sample from the transformer formula (app/core/models.py)."""
        return models.train_flops_per_token(model, info.seq_len) * info.seq_len

    def eval_metrics(self, loss: float) -> dict:
        return {}

    def save_files(self, folder: Path):
        """The config and tokenizer that make the checkpoint exportable in save_pretrained form (and with --lora,
        the adapters' peft config)."""
        models.save_hf_files(self.config, self.tokenizer, folder / models.HF_FILES)
        if self.adapters is not None:
            self.adapters.save_pretrained(str(folder / models.HF_FILES))


class CausalLM(TextTask):
    """Next-token prediction on blocks of text, or (named instruction once the data shows it, app/data/chat.py) on
    the answers of chats and of prompts with completions."""
    name = "causal_lm"
    loss = staticmethod(next_token_loss)
    correct = staticmethod(next_token_correct)

    def eval_metrics(self, loss: float) -> dict:
        return {"eval_perplexity": math.exp(min(loss, 700))}

    def sample_data(self, samples: int, seq_len: int) -> tuple:
        """(train set, DataInfo) for benchmarks: random token blocks, the byte-level tokenizer's ids for the model."""
        from app.data.tokenizers import byte_tokenizer
        self.tokenizer = byte_tokenizer()
        vocab = models.vocab_size(self.spec.config)
        blocks = torch.randint(vocab, (samples, seq_len), generator=torch.Generator().manual_seed(0))
        self.tokens_per_sample = seq_len
        return torch.utils.data.TensorDataset(blocks, blocks), DataInfo(0, task=self.name, vocab_size=vocab,
                                                                        seq_len=seq_len)


class SequenceClassification(TextTask):
    """One label per row of text."""
    name = "sequence_classification"
    loss = staticmethod(class_loss)
    correct = staticmethod(class_correct)

    def sample_data(self, samples: int, seq_len: int) -> tuple:
        raise UserError("the benchmark runs image classifiers and causal language models; "
                        f"{self.settings.model} is a sequence classifier")


class Preference(preference.Preference, TextTask):
    """Pairs of answers to one prompt, the DPO family's losses against a reference (app/core/preference.py)."""

    def __init__(self, settings: Settings, spec: models.HFSpec):
        TextTask.__init__(self, settings, spec)
        self.settle()

    def build_data(self, output_dir: Path) -> tuple:
        """As for any text task; a sample is a pair: two sequences of the padded length."""
        sets = super().build_data(output_dir)
        self.tokens_per_sample = 2 * sets[2].seq_len
        return sets

    def flops_per_sample(self, model: nn.Module, info: DataInfo) -> float:
        """A pair's training FLOPs: two sequences forward and backward, and a live reference's forward of both."""
        sequence = super().flops_per_sample(model, info)
        if self.reference_kind in ("adapters off", "frozen copy"):
            sequence += models.train_flops_per_token(model, info.seq_len, forward_only=True) * info.seq_len
        return 2 * sequence

    def build_model(self, info: DataInfo, ds_config: dict) -> nn.Module:
        """As for any text task, its dropout off (the model and the reference must score an answer alike, as TRL's
        disable_dropout does); a preset's weights drawn from --seed alone, so a frozen copy is the same model."""
        with lora.seeded(self.settings.seed) if not self.spec.pretrained else contextlib.nullcontext():
            model = super().build_model(info, ds_config)
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
        return model


def settled(task, ranks):
    """The task once the data is known: a causal LM whose rows hold preference pairs trains on them, under data
    parallel and ZeRO (ranks: the run's layout)."""
    if task.name == "preference" and (ranks.split or ranks.tensor > 1):
        raise UserError("preference pairs train under data parallel and ZeRO 0-3, not pipeline stages or tensor "
                        "parallelism: pick a ds_config without a pipeline or tensor_parallel section")
    if task.name != "preference" or isinstance(task, Preference):
        return task
    pairs = Preference(task.settings, task.spec)
    pairs.__dict__.update({k: v for k, v in vars(task).items() if k in vars(TextTask(task.settings, task.spec))})
    pairs.tokens_per_sample = 2 * task.tokens_per_sample  # two sequences a pair
    return pairs


def build(settings: Settings):
    """The task for settings.model and settings.task ('auto': the model's own)."""
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
        return ImageClassification(settings)
    name = spec.task if settings.task == "auto" else settings.task
    if name == "preference" and spec.task != "causal_lm":
        raise UserError(f"--task preference trains a causal language model on pairs of answers; {settings.model} is "
                        f"a sequence classifier: pass a causal LM")
    classes = {"sequence_classification": SequenceClassification, "preference": Preference}
    task = classes.get(name, CausalLM)(settings, spec)
    task.name = name
    return task


def auto_facts(task) -> ds_auto.Facts:
    """What "auto" values depend on besides the JSON: whether the model loads trained weights, its hidden size."""
    spec = getattr(task, "spec", None)
    if spec is None:
        return ds_auto.Facts()
    config = spec.config
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or getattr(config, "d_model", 0)
    folder = Path(spec.pretrained) if spec.pretrained else None
    weights = bool(spec.pretrained) and not (folder.is_dir() and not any(
        any(folder.glob(pattern)) for pattern in models.WEIGHT_FILES))
    blocks, block_size = models.block_shape(spec)
    return ds_auto.Facts(pretrained=weights, hidden=int(hidden or 0), blocks=blocks, block_size=block_size)
