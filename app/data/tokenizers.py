"""Tokenizers: the model's own, a byte-level one built locally, or BPE trained on the data; saved with the run."""
from pathlib import Path

from app.distributed import dist
from app.data import TextModel
from app.data.chat import ensure_template
from app.errors import UserError, first_line, folder_files
from app.settings import Settings

BOS = "<|endoftext|>"  # the locally built tokenizers' one separator: document end, and first token of a row
PAD = "<pad>"
TOKENIZER_DIR = "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model",
                   "spiece.model")


def _byte_backend():
    """A tokenizers.Tokenizer over the 256 bytes plus a separator and padding, with no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({BOS: len(vocab), PAD: len(vocab) + 1})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([BOS, PAD])
    backend.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    return backend


def _wrap(backend):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token=BOS, pad_token=PAD)


def byte_tokenizer():
    """A byte-level tokenizer needing no files or training: 256 bytes, a separator and padding."""
    return _wrap(_byte_backend())


def bpe_tokenizer(texts, vocab_size: int):
    """A byte-level BPE tokenizer trained on texts (an iterator of lists of strings) up to vocab_size tokens."""
    from tokenizers import pre_tokenizers, trainers
    backend = _byte_backend()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts, trainer=trainer)
    return _wrap(backend)


def _has_tokenizer(source: str) -> bool:
    """False for a local folder with no tokenizer files (transformers would make an empty tokenizer for it)."""
    folder = Path(source)
    return not folder.is_dir() or any((folder / name).is_file() for name in TOKENIZER_FILES)


def build_tokenizer(choice: str, model_source: str, vocab_size: int, texts):
    """The tokenizer --tokenizer asks for: '' (the model's own, else bytes), 'bytes', 'bpe', or a path/hub name."""
    from transformers import AutoTokenizer
    if choice == "bytes" or (not choice and not model_source):
        return byte_tokenizer()
    if choice == "bpe":
        return bpe_tokenizer(texts, vocab_size)
    if not choice and not _has_tokenizer(model_source):
        dist.print0(f"tokenizer: none in {model_source}; using a byte-level one built locally")
        return byte_tokenizer()
    try:
        tokenizer = AutoTokenizer.from_pretrained(choice or model_source)
    except Exception as e:
        raise UserError(f"cannot load the tokenizer in {folder_files(choice or model_source, TOKENIZER_FILES)} "
                        f"({first_line(e)}); it may be damaged or cut short: save it again, or pass --tokenizer "
                        f"with a folder saved by save_pretrained, 'bytes' or 'bpe'") from None
    if len(tokenizer) < 2 or not _has_tokenizer(choice or model_source):
        raise UserError(f"{choice or model_source} holds no usable tokenizer; pass a folder saved by "
                        f"save_pretrained, or --tokenizer bytes or bpe")
    if tokenizer.pad_token is None:  # GPT-2 style tokenizers have none; padding is masked out anyway
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.sep_token
    return tokenizer


def run_tokenizer(settings: Settings, model: TextModel, texts, output_dir: Path, chat: bool = False):
    """The main rank builds the run's tokenizer (texts(): an iterator of lists of strings, for BPE) and saves it in
    output_dir, with the default chat template when chat and it has none (app/data/chat.py); the other ranks load
    that copy."""
    from transformers import AutoTokenizer
    saved = Path(output_dir) / TOKENIZER_DIR
    if dist.is_main() and not (settings.resume and saved.is_dir()):
        tokenizer = build_tokenizer(settings.tokenizer, model.source, model.vocab_size, texts())
        if chat and ensure_template(tokenizer):
            dist.print0("chat template: the tokenizer has none; using the default (docs/instruction-tuning.md, "
                        "\"Instruction data\"), saved with it")
        tokenizer.save_pretrained(saved)
        return tokenizer
    return AutoTokenizer.from_pretrained(saved)
