"""Text data through HF datasets: local files or hub names -> a tokenizer -> fixed-length blocks or labelled rows
(app/data/text_sets.py puts them together)."""
import hashlib
import os
from pathlib import Path

import torch

from app.distributed import dist
from app.data import chat
from app.data.samples import Samples
from app.errors import UserError, first_line

START_RULE = "plain text opens with the tokenizer's start tokens"
"""Part of every tokenized cache's key: a cache made before plain text took them is not reused."""
# datasets.load_dataset builder for each file suffix it can read
FILE_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".ndjson": "json", ".csv": "csv",
                 ".parquet": "parquet"}
COMPRESSED = (".gz", ".bz2", ".xz", ".zst")
"""Compressions datasets reads text, JSON and CSV files through (chats.jsonl.gz)."""
SAVED = ("state.json", "dataset_dict.json")
"""What datasets' save_to_disk writes at the top of a Dataset's or a DatasetDict's folder."""


def kind(path: Path):
    """The builder of a data file by its suffix, in any case and under a compression datasets reads; None if none."""
    suffixes = [suffix.lower() for suffix in path.suffixes]
    if len(suffixes) > 1 and suffixes[-1] in COMPRESSED and FILE_BUILDERS.get(suffixes[-2]) != "parquet":
        return FILE_BUILDERS.get(suffixes[-2])
    return FILE_BUILDERS.get(suffixes[-1]) if suffixes else None


def saved_to_disk(path: Path) -> bool:
    """Whether path is a folder datasets' save_to_disk wrote (read with load_from_disk, not as files)."""
    return path.is_dir() and any((path / name).is_file() for name in SAVED)


def local_files(path: Path, source: str, eval_file: str = "") -> tuple:
    """(datasets builder, data_files) of a local file or folder of one kind (and --eval_file as the validation
    split)."""
    held = [Path(eval_file)] if eval_file else []
    if path.is_dir():  # an --eval_file inside the folder is held out of its training files
        train = [p for p in sorted(path.rglob("*")) if kind(p) and not any(p.resolve() == h.resolve() for h in held)]
    else:  # the same file named twice trains on it and evaluates on it, as asked
        train = [path]
    if not train:
        aside = f" besides --eval_file {eval_file}" if held else ""
        raise UserError(f"--dataset {source} holds no data file ({', '.join(FILE_BUILDERS)}){aside}")
    kinds = {kind(p) for p in train + held}
    if None in kinds or len(kinds) > 1:
        raise UserError(f"--dataset {source}: need files of one kind among {', '.join(FILE_BUILDERS)} (or "
                        f"{', '.join(COMPRESSED)} of them); found "
                        f"{', '.join(sorted({''.join(p.suffixes) or p.name for p in train + held}))}")
    data_files = {"train": [str(p) for p in train]}
    if all(os.path.getsize(p) == 0 for p in train):
        raise UserError(f"--dataset {source} has no training rows: its files are empty")
    if eval_file:
        data_files["validation"] = [eval_file]
    return kinds.pop(), data_files


def names_splits(path: Path, eval_file: str = "") -> bool:
    """Whether a local folder names its splits as a saved hub dataset does, so that datasets reads them apart: a
    README.md whose YAML header lists configs, or data files whose names claim a train split and another (train-*,
    data/test-*, ...), --eval_file not among them (unclaimed() names the files no split claims, which datasets
    leaves out). Any other folder is one training set, every file of it."""
    if not path.is_dir():
        return False
    readme = path / "README.md"
    head = readme.read_text(errors="replace").split("\n---", 1)[0] if readme.is_file() else ""
    if head.startswith("---\n") and "\nconfigs:" in head:
        return True
    named = _named_files(path)
    data = {p.resolve() for p in path.rglob("*") if kind(p)}
    return "train" in named and len(named) > 1 and not (eval_file and Path(eval_file).resolve() in data)


def _named_files(path: Path) -> dict:
    """{split: its files} as datasets finds them by their names in a folder ({} where it finds none)."""
    from datasets.data_files import DataFilesDict, get_data_patterns
    try:
        return DataFilesDict.from_patterns(get_data_patterns(str(path)), base_path=str(path))
    except Exception:  # no data file, or names datasets cannot read as splits
        return {}


def unclaimed(path: Path) -> list:
    """The data files of a folder that names its splits which no split's name claims (imdb's unsupervised-*)."""
    claimed = {Path(f).resolve() for files in _named_files(path).values() for f in files}
    return sorted(p.name for p in path.rglob("*") if kind(p) and p.resolve() not in claimed)


def _local_splits(path: Path, source: str, eval_file: str, config_name: str):
    """The splits of a local file or folder of one kind, of a folder that names its splits, or of one datasets'
    save_to_disk wrote (and --eval_file as the validation split)."""
    import datasets
    try:
        if saved_to_disk(path):
            splits = datasets.load_from_disk(str(path))
            splits = splits if isinstance(splits, datasets.DatasetDict) else datasets.DatasetDict(train=splits)
        elif not names_splits(path, eval_file):
            builder, data_files = local_files(path, source, eval_file)
            return datasets.load_dataset(builder, data_files=data_files)
        else:
            splits = datasets.load_dataset(str(path), config_name or None)
            left = unclaimed(path) if not (path / "README.md").is_file() else []
            if left:
                dist.print0(f"--dataset {source}: its files name their splits ({', '.join(splits)}); left out, as no "
                            f"split's name claims them: {', '.join(left[:4])}{' ...' if len(left) > 4 else ''}")
        if eval_file:
            splits["validation"] = _local_splits(Path(eval_file), eval_file, "", "")["train"]
        return splits
    except UserError:
        raise
    except Exception as e:  # malformed files surface as many exception types inside datasets
        raise UserError(f"cannot read --dataset {source}: {first_line(e)}") from None


def check_split(names, source: str, flag: str, name: str):
    """A split name the dataset lacks is one line listing the ones it has."""
    if name not in names:
        raise UserError(f"--dataset {source} has no split {name!r}; its splits are {', '.join(names)}: pass "
                        f"{flag} with one of them")


def check_held_out(test_split: str, train_split: str):
    """--dataset_test_split naming the training split is one line."""
    if test_split == train_split:
        raise UserError(f"--dataset_test_split {test_split} is the training split too: the held-out rows must be "
                        f"others; name another split, or leave it out to hold out --eval_fraction of the rows")


HELD_OUT = ("validation", "test")  # the splits held out by default, the first found that is not the training one


def picked(splits, source: str, train_split: str, test_split: str, hold_out: bool = True) -> tuple:
    """(the training split, the held-out one or None): --dataset_train_split, and --dataset_test_split or else
    validation, else test, never the training split (when held out here)."""
    train_split = train_split or "train"
    check_split(splits, source, "--dataset_train_split", train_split)
    if test_split and hold_out:
        check_split(splits, source, "--dataset_test_split", test_split)
    if len(splits[train_split]) == 0:
        raise UserError(f"--dataset {source} has no training rows; check the file or the split names")
    if hold_out:
        check_held_out(test_split, train_split)
    held = (test_split or next((s for s in HELD_OUT if s in splits and s != train_split), "")) if hold_out else ""
    return splits[train_split], splits[held] if held else None


def load_splits(source: str, config_name: str, eval_file: str, eval_fraction: float, seed: int, hold_out: bool = True,
                splits_named: tuple = ("train", "")):
    """(train, held-out) HF datasets from a local file or folder, or a hub dataset name; hold_out False: (all of its
    training rows, None), the held-out set coming from elsewhere; splits_named: the training split's name and the
    held-out one's ('': validation, else test)."""
    import datasets
    datasets.disable_progress_bars()
    if Path(source).exists():
        splits = _local_splits(Path(source), source, eval_file, config_name)
    else:
        if eval_file:
            raise UserError("--eval_file goes with a local --dataset file or folder, not a hub dataset")
        try:
            splits = datasets.load_dataset(source, config_name or None)
        except Exception as e:
            offline = " (HF_HUB_OFFLINE=1 forbids downloads)" if os.environ.get("HF_HUB_OFFLINE") == "1" else ""
            raise UserError(f"--dataset {source!r} is not a local file or folder, nor a hub dataset that loads"
                            f"{offline}: {first_line(e)}") from None
    train, eval_set = picked(splits, source, *splits_named, hold_out=hold_out)
    if eval_set is not None or not hold_out:
        return train, eval_set
    if len(train) < 2:
        raise UserError(f"--dataset {source} has one row: not enough to hold some out; add rows or pass --eval_file")
    parts = train.train_test_split(test_size=eval_fraction, seed=seed)
    return parts["train"], parts["test"]


def pick_column(dataset, wanted: str, role: str, defaults: tuple) -> str:
    """The column named wanted, else the first default present, else (text) the only string column."""
    from datasets import Value
    columns = dataset.column_names
    if wanted:
        if wanted not in columns:
            raise UserError(f"--{role}_column {wanted!r} is not in the dataset; its columns are: {', '.join(columns)}")
        return wanted
    found = [c for c in defaults if c in columns]
    if not found and role == "text":
        found = [c for c, f in dataset.features.items()
                 if isinstance(f, Value) and f.dtype in ("string", "large_string")]
    if len(found) == 1 or (found and found[0] in defaults):
        return found[0]
    raise UserError(f"cannot tell which column holds the {role}; pass --{role}_column, one of: {', '.join(columns)}")


def cache_key(dataset, tokenizer, *settings) -> str:
    """A datasets fingerprint for tokenizing this dataset with this tokenizer and these settings."""
    vocab = tokenizer.backend_tokenizer.to_str() if tokenizer.is_fast else repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(repr((dataset._fingerprint, vocab, START_RULE, settings)).encode()).hexdigest()[:32]


def mapped(dataset, encode, key: str, what: str, unit: str, with_indices: bool = False):
    """dataset.map(encode) under a fingerprint of our own, so ranks and later runs reuse the cached result."""
    cache = [f["filename"] for f in dataset.cache_files]
    reused = bool(cache) and os.path.exists(os.path.join(os.path.dirname(cache[0]), f"cache-{key}.arrow"))
    result = dataset.map(encode, batched=True, remove_columns=dataset.column_names, new_fingerprint=key,
                         with_indices=with_indices)
    dist.print0(f"{what}: {len(result)} {unit} ({'reused the tokenized cache' if reused else 'tokenized'})")
    return result


def lm_blocks(dataset, tokenizer, column: str, block_size: int, what: str):
    """Every text, the tokenizer's start tokens before it (chat.start_ids) and the separator after it, concatenated
    and cut into blocks of block_size tokens."""
    sep = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    start = list(chat.start_ids(tokenizer))

    def encode(batch):
        ids = tokenizer([t or "" for t in batch[column]], add_special_tokens=False)["input_ids"]
        flat = [token for doc in ids for token in start + doc + ([sep] if sep is not None else [])]
        usable = len(flat) // block_size * block_size
        return {"input_ids": [flat[i:i + block_size] for i in range(0, usable, block_size)]}
    return mapped(dataset, encode, cache_key(dataset, tokenizer, "lm", column, block_size), what,
                   f"blocks of {block_size} tokens")


def instruction_rows(dataset, tokenizer, form: str, block: int, whole_text: bool, what: str):
    """Rows rendered with the chat template and labelled on their answers (app/data/chat.py), cut to block tokens;
    says once how many were cut, and leaves out those the cut left without an answer token."""
    key = cache_key(dataset, tokenizer, "instruction", form, block, whole_text, tokenizer.chat_template)
    rows = mapped(dataset, chat.encoder(tokenizer, form, block, whole_text, what), key, what, "rows", with_indices=True)
    cut, empty = sum(rows["cut"]), list(rows["units"]).count(0)
    if cut:
        lost = f"; {empty} lost every answer token and are left out" if empty else ""
        dist.print0(f"{what}: {cut} of {len(rows)} rows are longer than the block of {block} tokens and were cut"
                    f"{lost} (--block_size sets the block)")
    if empty:
        rows = rows.filter(lambda units: units > 0, input_columns="units", new_fingerprint=key + "-kept")
        rows = rows.flatten_indices(new_fingerprint=key + "-flat")  # its arrow table then holds the kept rows alone
    if not len(rows):
        raise UserError(f"no {what} row keeps an answer token within the block of {block} tokens; raise "
                        f"--block_size (the model reads up to its positions)")
    return rows


def chat_texts(dataset, form: str):
    """An iterator of lists of strings: the text of every turn, prompt and completion (to train a BPE tokenizer)."""
    for batch in dataset.iter(batch_size=1000):
        columns = {"prompt_completion": ("prompt", "completion"), "alpaca": ("instruction", "input", "output"),
                   "explicit": ("prompt", "conversations", "chosen", "rejected"),
                   "implicit": ("chosen", "rejected")}.get(form, (form,))
        texts = []
        for column in columns:
            for value in batch.get(column, []):
                turns = value if isinstance(value, list) else [value] if isinstance(value, dict) else \
                    [{"content": value}]
                texts += [t.get("content", t.get("value")) for t in turns
                          if isinstance(t, dict) and isinstance(t.get("content", t.get("value")), str)]
        yield texts


class Rows(Samples):
    """(input, target) from a tokenized dataset: (ids, ids) for language modelling, ((ids, mask), label) else."""

    def __init__(self, dataset, pad_id: int, length: int = 0):
        self.dataset = dataset.with_format("torch")
        self.pad_id, self.length = pad_id, length  # length: pad every row to it (classification)

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        row = self.dataset[i]
        ids = row["input_ids"]
        if not self.length:
            return ids, ids
        mask = torch.zeros(self.length, dtype=torch.long)
        mask[:len(ids)] = 1
        padded = torch.full((self.length,), self.pad_id, dtype=torch.long)
        padded[:len(ids)] = ids
        return (padded, mask), row["target"]


def longest(dataset, column: str = "input_ids") -> int:
    """The most tokens a row of the column holds."""
    counts = chat.token_counts(dataset, column)
    return int(counts.max()) if len(counts) else 0
