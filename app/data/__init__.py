"""Data: image sources (images.py), text sources (text.py) and tokenizers (tokenizers.py) make datasets, each
declaring what the loader reads of it (samples.py); loader.py shards them across ranks. Data is a run's sets;
DataInfo tells the model what the data looks like; TextModel tells text data what the model reads."""
from dataclasses import dataclass


@dataclass
class DataInfo:
    """What a model needs to know about the data."""
    num_classes: int
    in_channels: int = 0
    image_size: int = 0
    task: str = "image_classification"
    """image_classification, causal_lm or sequence_classification."""
    vocab_size: int = 0
    """Tokens in the tokenizer (text only)."""
    seq_len: int = 0
    """Tokens per sample (text only): the block length, or the padded row length."""
    packed: bool = False
    """Samples are rows packed into blocks: the model takes position ids beside the input ids."""
    labels: tuple = ()
    """The classes' names, in the order of the head's rows (text classification)."""


@dataclass(frozen=True)
class TextModel:
    """What text data needs to know of a transformers model."""
    source: str
    """A save_pretrained folder or hub name its own tokenizer may come from; '' for a model built from a preset."""
    vocab_size: int
    """Tokens its embedding really has (without padding rows)."""
    max_positions: int
    labels: tuple = ()
    """A pretrained classifier's label names, in its head's order (none when its config names none)."""


@dataclass(frozen=True)
class Data:
    """A run's data: the training set, the held-out set (or None) and what the model needs to know about them."""
    train: object
    held_out: object
    info: DataInfo
