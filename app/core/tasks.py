"""The kinds of training on a single model: image classification, causal language modelling on blocks of text,
instruction tuning on the answers of chats and of prompts with completions, sequence classification (preference
pairs: app/core/preference.py). Each implements the task contract (app/core/task.py); app/core/resolver.py picks
one for a run."""
import contextlib
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from app.core import lora, models, packing
from app.core.fused_loss import TokenSums, counted_next_tokens
from app.core.task import Task
from app.data import Data
from app.data import DataInfo, TextModel
from app.data.labels import head_names
from app.data.chat import IGNORE, PackedRows
from app.distributed import dist
from app.errors import UserError
from app.settings import Settings


def class_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy of each sample, in fp32."""
    return F.cross_entropy(logits.float(), labels, reduction="none")


def class_correct(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """1.0 where the top class is the label, else 0.0."""
    return (logits.argmax(-1) == labels).float()


def _next_token(logits: torch.Tensor, labels: torch.Tensor):
    """Language-model logits as rows (batch x positions, vocab), each paired with the token it predicts, and
    how many tokens each sample predicts."""
    rows, targets = logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1)
    return rows, targets, counted_next_tokens(labels)


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each sample's mean next-token cross entropy over the tokens it is labelled on, in fp32 (from the logits, or
    from the sums a tiled output layer returns in their place: app/core/fused_loss.py)."""
    if isinstance(logits, TokenSums):
        return logits.loss / counted_next_tokens(labels)
    rows, targets, counted = _next_token(logits, labels)
    losses = F.cross_entropy(rows.float(), targets, reduction="none", ignore_index=IGNORE)
    return losses.view(len(logits), -1).sum(1) / counted


def next_token_correct(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each sample's share of the next tokens it is labelled on predicted right."""
    if isinstance(logits, TokenSums):
        return logits.right / counted_next_tokens(labels)
    rows, targets, counted = _next_token(logits, labels)
    right = (rows.argmax(-1) == targets) & (targets != IGNORE)
    return right.view(len(logits), -1).sum(1) / counted


def image_data(settings: Settings) -> Data:
    """A torchvision dataset or a built-in one; an unreadable image is refused on every rank before any write."""
    from app.data.images import build_image_sets, unreadable_images
    with dist.main_process_first():  # rank 0 downloads, the others then read its files
        train, held, info = build_image_sets(settings.dataset, settings.data_dir, settings.image_size,
                                             imagenet=bool(settings.model_weights))
    problem = dist.broadcast_object(unreadable_images(train, held) if dist.is_main() else "")
    if problem:
        raise UserError(problem)
    return Data(train, held, info)


class ImageClassification(Task):
    """A torchvision dataset or a built-in one, a built-in or torchvision classifier."""
    name = "image_classification"
    loss = staticmethod(class_loss)
    correct = staticmethod(class_correct)

    def sample_data(self, samples: int, seq_len: int) -> tuple:
        """(train set, DataInfo) for benchmarks, whatever the size asked: the digits for the built-in models,
        3x32x32 synthetic images for torchvision classifiers."""
        from app.data.images import build_image_sets
        return build_image_sets("digits" if self.settings.model in models.BUILTIN else "synthetic", "data")[::2]

    def build_model(self, info: DataInfo, ds_config: dict) -> nn.Module:
        return models.build_model(self.settings.model, info, self.settings.model_weights)

    def flops_per_sample(self, model: nn.Module, info: DataInfo) -> float:
        """Training FLOPs of one sample, counted on a forward and backward pass."""
        return models.counted_flops_per_sample(model, info)


def text_data(settings: Settings, spec: models.HFSpec, asked: str, output_dir: Path) -> tuple:
    """(Data, tokenizer, the kind the rows are: causal_lm, instruction, preference or sequence_classification),
    tokenized once on the main rank and cached; asked: the task the flags or the model name."""
    from app.data.images import BUILDERS
    from app.data.text_sets import build_text_sets
    if settings.dataset in BUILDERS:
        raise UserError(f"{settings.model} is a transformers model and trains on text, not {settings.dataset}; pass "
                        f"--dataset <.txt/.json/.jsonl/.csv/.parquet file or folder, or a hub dataset>")
    model = TextModel(spec.pretrained, models.vocab_size(spec.config), spec.max_positions,
                      head_names(spec.config, spec.pretrained))
    train, held, info, tokenizer, kind = build_text_sets(settings, model, asked, output_dir)
    return Data(train, held, info), tokenizer, kind


class TextTask(Task):
    """What the transformers tasks share: text data through a tokenizer, the model from its HFSpec."""
    bench_batch = 16
    sequences = 1
    """Sequences in one sample (a preference pair: 2)."""

    def __init__(self, settings: Settings, spec: models.HFSpec, data: Data = None, tokenizer=None):
        super().__init__(settings, data)
        self.spec, self.tokenizer, self.config, self.adapters, self.generation = spec, tokenizer, None, None, None
        self.tokens_per_sample = self.sequences * data.info.seq_len if data is not None else 0

    def per_sample(self) -> dict:
        """Instruction data: the rows and real (not padding) tokens of a sample, on average; else nothing."""
        return self.data.train.per_sample()

    def build_model(self, info: DataInfo, ds_config: dict) -> nn.Module:
        """The transformers model as HFLogits; with --lora, its adapters on the frozen base (a preset's base
        initialised from --seed alone, so that a resumed run builds the same one)."""
        settings = self.settings
        with lora.seeded(settings.seed) if settings.lora and not self.spec.pretrained else contextlib.nullcontext():
            model = models.build_hf(self.spec, info, self.tokenizer, ds_config, settings.attention)
        self.config = model.hf.config  # not the model: a pipeline stage keeps only its own layers
        self.generation = getattr(model.hf, "generation_config", None)  # the base's sampling defaults, end tokens
        if settings.lora:
            model.hf = lora.wrap(model.hf, settings, self.name)
            self.adapters = model.hf.peft_config["default"]
        return model

    def end_ids(self) -> tuple:
        """The tokens that end a generated answer: the tokenizer's end token and those of the model's
        generation_config.json (Gemma's <end_of_turn>, Llama 3's and Phi-3's end of a turn), as HF generate stops."""
        said = getattr(self.generation, "eos_token_id", None)
        return tuple(sorted({self.tokenizer.eos_token_id, *(said if isinstance(said, list) else [said])} - {None}))

    def flops_per_sample(self, model: nn.Module, info: DataInfo) -> float:
        """Training FLOPs of one sample from the transformer formula (app/core/models.py)."""
        return self.sequences * models.train_flops_per_token(model, info.seq_len) * info.seq_len

    def save_files(self, folder: Path):
        """The config and tokenizer that make the checkpoint exportable in save_pretrained form (and with --lora,
        the adapters' peft config)."""
        models.save_hf_files(self.config, self.tokenizer, folder / models.HF_FILES, self.generation)
        if self.adapters is not None:
            self.adapters.save_pretrained(str(folder / models.HF_FILES))


DROPOUT_WORDS = ("dropout", "pdrop", "layerdrop")
"""Words in the name of a module's float that holds a dropout rate it hands to torch's functional dropout or to
attention (OPT's layers, attention's attention_dropout, OPT's and BART's LayerDrop)."""


def without_dropout(model: nn.Module) -> nn.Module:
    """The model with every dropout off: the trained model and its reference score a sequence alike (TRL's
    disable_dropout, and also the rates modules keep as numbers, which TRL's leaves on)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        rates = [name for name, value in vars(module).items()
                 if isinstance(value, float) and any(word in name for word in DROPOUT_WORDS)]
        for name in rates:
            setattr(module, name, 0.0)
    return model


def answer_prompts(held, count: int) -> list:
    """[(prompt ids, expected answer ids)] of the first `count` rows of a held-out set of instruction rows or pairs
    (packed: the rows inside its blocks)."""
    rows = held.rows if isinstance(held, PackedRows) else held
    return [held.prompt(i) for i in range(min(count, len(rows)))]


class CausalLM(TextTask):
    """Next-token prediction on blocks of text."""
    name = "causal_lm"
    splits_sequences = tiled_loss = True
    loss = staticmethod(next_token_loss)
    correct = staticmethod(next_token_correct)
    summary_metrics = ("eval_loss", "eval_accuracy", "eval_perplexity")

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


class Instruction(CausalLM):
    """Next-token prediction on the answers of chats and of prompts with completions (app/data/chat.py); each
    evaluation shows the model's answers to the first held-out prompts."""
    name = "instruction"

    def answer_prompts(self, count: int) -> list:
        return answer_prompts(self.data.held_out, count)

    def before_load(self, engine, ds: dict, output_dir: Path):
        """Packed rows: refuse, in one line, a model whose attention lets them see each other."""
        if self.data.info.packed:
            packing.check(engine, self, self.data.train)


class SequenceClassification(TextTask):
    """One label per row of text."""
    name = "sequence_classification"
    loss = staticmethod(class_loss)
    correct = staticmethod(class_correct)

    def sample_data(self, samples: int, seq_len: int) -> tuple:
        raise UserError("the benchmark runs image classifiers and causal language models; "
                        f"{self.settings.model} is a sequence classifier")
