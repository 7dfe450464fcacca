"""Model builders by name: built-ins and torchvision classifiers (build_model), transformers presets, folders
and hub names (hf_spec, then build_hf)."""
import copy
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from app.core import classifiers, fused_loss
from app.data import DataInfo
from app.ds import precision
from app.errors import UserError, first_line, folder_files


def _cnn(info: DataInfo) -> nn.Module:
    """A small CNN: two 3x3 convolutions, pooled to 4x4, then two linear layers (the digits default)."""
    return nn.Sequential(
        nn.Conv2d(info.in_channels, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(4), nn.Flatten(),
        nn.Linear(64 * 16, 128), nn.ReLU(),
        nn.Linear(128, info.num_classes))


def _mlp(info: DataInfo) -> nn.Module:
    """A two-layer perceptron over the flattened image."""
    return nn.Sequential(nn.Flatten(), nn.Linear(info.in_channels * info.image_size ** 2, 64), nn.ReLU(),
                         nn.Linear(64, info.num_classes))


BUILTIN = {"cnn": _cnn, "mlp": _mlp}
LLAMA_TINY = dict(num_hidden_layers=4, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, vocab_size=8192, tie_word_embeddings=False)
LLAMA3 = dict(num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0)  # Llama 3's, with its tokenizer's vocab
# Randomly initialised transformers built from a config, no download. No dropout, as in from-scratch pretraining.
PRESETS = {
    "gpt2-tiny": ("gpt2", dict(n_layer=4, n_embd=256, n_head=4, n_positions=128, vocab_size=8192)),
    "gpt2-124m": ("gpt2", dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257)),
    # a Llama for tensor parallelism (AutoTP follows transformers' plan for llama); at 32,768 positions, long sequences
    "llama-tiny": ("llama", LLAMA_TINY),
    "llama-tiny-long": ("llama", {**LLAMA_TINY, "max_position_embeddings": 32768}),
    "bert-tiny": ("bert", dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, intermediate_size=512,
                               max_position_embeddings=512, vocab_size=8192)),
    # the ZeRO paper's 7.5B GPT-2 shape (7.46B parameters), for the memory plan at scale
    "gpt2-7b": ("gpt2", dict(n_layer=36, n_embd=4096, n_head=32, n_positions=1024, vocab_size=50257)),
    # Llama 3.2 1B's and 3B's shapes (1.24B and 3.21B parameters, tied embeddings), for the memory plan and real runs
    "llama-1b": ("llama", dict(LLAMA3, num_hidden_layers=16, hidden_size=2048, intermediate_size=8192,
                               num_attention_heads=32, max_position_embeddings=131072, tie_word_embeddings=True)),
    "llama-3b": ("llama", dict(LLAMA3, num_hidden_layers=28, hidden_size=3072, intermediate_size=8192,
                               num_attention_heads=24, max_position_embeddings=131072, tie_word_embeddings=True)),
    # Llama 3.1 8B's shape (8.03B parameters), at its original 8,192 positions: what people fine-tune with LoRA
    "llama-8b": ("llama", dict(LLAMA3, num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
                               num_attention_heads=32, max_position_embeddings=8192, tie_word_embeddings=False)),
}
# Vocabularies are padded to a multiple of this for the matmul kernels, as nanoGPT and llm.c do (50,257 ->
# 50,304 for GPT-2); the padded rows' logits are -inf, so they never win nor take probability.
VOCAB_MULTIPLE = 64
NO_DROPOUT = {"gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None),
              "bert": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
              "llama": dict(attention_dropout=0.0)}
PRESET_ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "bert": "BertForSequenceClassification",
                        "llama": "LlamaForCausalLM"}


@dataclass
class HFSpec:
    """A transformers model before it is built: its config, where weights come from, what it is for."""
    config: object
    pretrained: str
    """A save_pretrained folder or hub name to load weights (and a tokenizer) from; '' builds from the config."""
    task: str
    max_positions: int


def _task_of(config) -> str:
    """The task a config's architecture was saved for; if it names none, causal LM for decoder-only families."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_MASKED_LM_MAPPING
    arch = (config.architectures or [""])[0]
    if arch.endswith("ForSequenceClassification"):
        return "sequence_classification"
    if arch.endswith(("LMHeadModel", "ForCausalLM")):
        return "causal_lm"
    decoder_only = type(config) in MODEL_FOR_CAUSAL_LM_MAPPING and type(config) not in MODEL_FOR_MASKED_LM_MAPPING
    return "causal_lm" if decoder_only else "sequence_classification"


def hf_spec(name: str):
    """The HFSpec for a preset, a save_pretrained folder or a hub name; None for image models."""
    if name in BUILTIN:  # before importing torchvision, which takes seconds
        return None
    if name in classifiers.names():
        return None
    from transformers import AutoConfig
    if name in PRESETS:
        family, shape = PRESETS[name]
        config, source = AutoConfig.for_model(family, **shape, **NO_DROPOUT[family]), ""
        config.architectures = [PRESET_ARCHITECTURES[family]]
        pad_vocab(config)
    else:
        from app.core import hf_config
        config, source = hf_config.read(name, ", ".join(PRESETS)), name
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 0)
    return HFSpec(config, source, _task_of(config), positions)


def check_weights(folder: str):
    """A save_pretrained folder with a config.json and no weights (a download stopped early, a folder of the config
    alone, a Trainer's folder of training_args.bin) is one line before the data is read; the plan, which needs the
    config alone, does not ask."""
    if not any(next(Path(folder).glob(pattern), None) for pattern in ("*.safetensors", "pytorch_model*.bin")):
        raise UserError(f"model folder {folder} has a config.json but no weights (model.safetensors, "
                        f"pytorch_model.bin or their shards): copy them in beside it, or pass a preset "
                        f"({', '.join(PRESETS)}) to train a model from scratch")


def pad_vocab(config):
    """Round the config's vocabulary up to a multiple of VOCAB_MULTIPLE, keeping the real size beside it."""
    real = config.vocab_size
    config.vocab_size = -(-real // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    if config.vocab_size != real:
        config.unpadded_vocab_size = real


def vocab_size(config) -> int:
    """Tokens a config's model really has: its vocabulary without the padding rows."""
    return getattr(config, "unpadded_vocab_size", None) or config.vocab_size


class HFLogits(nn.Module):
    """A transformers model that returns its logits alone, so the loop treats it like any classifier."""

    def __init__(self, hf, real_vocab: int = 0, second: str = "attention_mask"):
        super().__init__()
        self.hf, self.real_vocab = hf, real_vocab  # a padded vocabulary (language models): the tokens past it masked
        self.second = second  # the second input: an attention mask (classification) or position ids (packed, SP)

    @property
    def config(self):
        """The transformers config: DeepSpeed AutoTP reads the model family's tensor-parallel plan from it."""
        return self.hf.config

    @property
    def _tp_plan(self):
        """The model's own tensor-parallel plan (its output layer's entry lives only here), for AutoTP."""
        return self.hf.__dict__.get("_tp_plan") or getattr(type(self.hf), "_tp_plan", None)

    def forward(self, input_ids, second=None, targets=None):
        if targets is not None:  # --tiled: the next-token loss's TokenSums, never the whole logits
            return fused_loss.hf_token_sums(self, input_ids, second, targets)
        return fused_loss.masked_padding(self.hf(input_ids=input_ids, **{self.second: second}).logits, self.real_vocab)


def hf_class(task: str):
    """The transformers Auto class for a task."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    return AutoModelForCausalLM if task == "causal_lm" else AutoModelForSequenceClassification


def named_blocks(model: nn.Module) -> list:
    """A transformers model's layers: the instances of the most frequent of the classes it names not to split (BERT
    names its embeddings too); [] for a model that names none."""
    named = set(getattr(getattr(model, "hf", model), "_no_split_modules", None) or ())
    layers = Counter(type(m) for m in model.modules() if type(m).__name__ in named)
    if not layers:
        return []
    return [m for m in model.modules() if type(m) is layers.most_common(1)[0][0]]


def block_shape(spec: HFSpec) -> tuple:
    """(class names of the model's transformer blocks, parameters of its largest block), from its config alone (built
    on the meta device, nothing allocated); ((), 0) where it names no block."""
    with torch.device("meta"):
        found = named_blocks(hf_class(spec.task).from_config(copy.deepcopy(spec.config)))
    if not found:
        return (), 0
    return (type(found[0]).__name__,), max(sum(p.numel() for p in block.parameters()) for block in found)


def build_hf(spec: HFSpec, info: DataInfo, tokenizer, ds_config: dict, attention: str = "") -> nn.Module:
    """The transformers model, its parameters partitioned as they are made when ds_config is ZeRO-3; attention:
    its attention implementation ('' the model's default)."""
    config = copy.deepcopy(spec.config)
    config.update({"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                   "pad_token_id": tokenizer.pad_token_id, "use_cache": False})
    if info.task == "sequence_classification" and (info.labels or config.num_labels != info.num_classes):
        names = info.labels or [str(i) for i in range(info.num_classes)]  # the data's, which the export keeps
        config.id2label, config.label2id = dict(enumerate(names)), {name: i for i, name in enumerate(names)}
    zero3 = ds_config.get("zero_optimization", {}).get("stage", 0) == 3
    if zero3:  # from_config / from_pretrained then build under deepspeed.zero.Init
        from transformers.integrations import HfDeepSpeedConfig
        alive = HfDeepSpeedConfig(ds_config)  # noqa: F841 (transformers holds only a weak reference)
    cls, chosen = hf_class(info.task), {"attn_implementation": attention} if attention else {}
    chosen["dtype"] = precision.weights_dtype(ds_config)  # not config.json's (mostly bf16)
    if spec.pretrained:
        from safetensors import SafetensorError
        try:
            hf = cls.from_pretrained(spec.pretrained, config=config,  # a new classifier head may differ in size
                                     ignore_mismatched_sizes=info.task == "sequence_classification", **chosen)
        except (OSError, ValueError, RuntimeError, SafetensorError, ImportError) as e:  # however the format says it
            _attention_refused(e, attention)
            raise UserError(f"{folder_files(spec.pretrained, WEIGHT_FILES)} cannot be read ({first_line(e)}): the "
                            f"folder may be damaged or cut short; write it again with save_pretrained, or copy it "
                            f"again") from None
    else:
        try:
            hf = cls.from_config(config, **chosen)
        except (ValueError, ImportError) as e:
            _attention_refused(e, attention)
            raise
    hf.config.architectures = [type(hf).__name__]
    padded = info.task == "causal_lm" and vocab_size(config) < config.vocab_size
    positions = info.packed or ds_config.get("sequence_parallel_size", 1) > 1  # packed, or a slice of each sequence
    return HFLogits(hf, vocab_size(config) if padded else 0, "position_ids" if positions else "attention_mask")


def _attention_refused(error: Exception, attention: str):
    """A UserError when transformers refused the --attention asked for (unknown, or its package missing)."""
    if attention and attention in str(error):
        raise UserError(f"--attention {attention}: {first_line(error)}") from None


HF_FILES = "hf"  # a checkpoint's folder for the config and tokenizer, for export in save_pretrained form
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


def save_hf_files(config, tokenizer, folder, generation=None):
    """The config and tokenizer that make a checkpoint exportable in save_pretrained form, and the base model's
    generation settings (generation: its GenerationConfig, None for a model that does not generate)."""
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if generation is not None:
        generation.save_pretrained(folder)


def exported_config(files):
    """The run's transformers config from a checkpoint's hf folder as an exported model takes it: with the KV cache
    that training turns off turned on, so that generate() uses it."""
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(files, use_cache=True)


def train_flops_per_token(model: nn.Module, seq_len: int, forward_only: bool = False) -> float:
    """6 x parameters in matmuls + 12 x layers x width x sequence (forward and backward; PaLM, appendix B); a
    forward alone (forward_only: a reference model's) is a third of that: 2 and 4.

    Embedding lookups are not matmuls; an output layer tied to the input embedding is. A frozen weight (LoRA's base
    model) takes 4, not 6: its backward computes the input's gradient but not its own.
    """
    hf = model.hf
    out, tied = hf.get_output_embeddings(), set()
    if out is not None:
        tied.add(id(out.weight))
    lookups = {id(m.weight) for m in hf.modules() if isinstance(m, nn.Embedding)} - tied
    flops = sum((2.0 if forward_only else 6.0 if p.requires_grad else 4.0) * getattr(p, "ds_numel", p.numel())
                for p in hf.parameters() if id(p) not in lookups)
    return flops + (4.0 if forward_only else 12.0) * hf.config.num_hidden_layers * hf.config.hidden_size * seq_len


def model_names() -> list:
    """Every name --model accepts besides folders and hub names."""
    return sorted(BUILTIN) + sorted(PRESETS) + classifiers.names()


def build_model(name: str, info: DataInfo, weights: str = "") -> nn.Module:
    """The image model called name (a built-in or a torchvision classifier), shaped for the data info describes;
    weights: a torchvision classifier's pretrained ones to start from."""
    if name in BUILTIN:
        if weights:
            raise UserError(f"--model_weights starts a torchvision classifier from pretrained weights; {name} is "
                            f"the app's own, trained from scratch")
        return BUILTIN[name](info)
    if name in classifiers.names():
        return classifiers.build(name, info, weights)
    raise UserError(f"unknown model {name!r}; choose cnn, mlp or a torchvision classifier such as resnet18 "
                    f"(python -c 'import torchvision; print(torchvision.models.list_models())')")


def counted_flops_per_sample(model: nn.Module, info: DataInfo) -> float:
    """Training FLOPs of one image sample, counted by torch on a forward and backward pass of two."""
    from torch.utils.flop_counter import FlopCounterMode
    x = torch.randn(2, info.in_channels, info.image_size, info.image_size)
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / 2
