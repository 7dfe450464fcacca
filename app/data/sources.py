"""Several training sources in one run (docs/data-and-models.md, "Several datasets"): `--dataset a,b` loads and
tokenizes each source in its own form and concatenates them; `--mix_weights` draws each epoch's rows from them by
weight (of rows, or of tokens with `--mix_by tokens`) inside the one global sample order; each source keeps its
held-out part, evaluated on its own (`eval_loss/<name>`) and combined."""
import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from app.errors import UserError


def split_sources(dataset: str) -> list:
    """The sources --dataset names: one, or several separated by commas (a path that exists is one, commas and all)."""
    if "," not in dataset or Path(dataset).exists():
        return [dataset]
    parts = [part.strip() for part in dataset.split(",")]
    if not all(parts):
        raise UserError(f"--dataset {dataset!r} has an empty name between its commas; name each source once")
    return parts


def source_names(sources: list) -> list:
    """A short name for each source: a file's stem, a folder's name, a hub dataset's last part; numbered where two
    are alike. They name the per-source columns: eval_loss/<name>, rows/<name>, tokens/<name>."""
    names = [Path(s).stem if Path(s).is_file() else Path(s).resolve().name if Path(s).is_dir() else
             s.rstrip("/").split("/")[-1] for s in sources]
    alone, named = {name for name in names if names.count(name) == 1}, []
    for name in names:  # a name alike numbered past any source's own (a-2.jsonl keeps a-2 beside two a's)
        named.append(name if name in alone else next(f"{name}-{n}" for n in itertools.count(1)
                                                     if f"{name}-{n}" not in alone and f"{name}-{n}" not in named))
    return named


def eval_files(eval_file: str, sources: list) -> list:
    """--eval_file split for the sources: [] (each source's own held-out split), one file (the held-out set of all
    of them together), or with several sources one file each, in order (each evaluated on its own)."""
    files = [part.strip() for part in eval_file.split(",")] if eval_file and len(sources) > 1 else \
        [eval_file] if eval_file else []
    if len(files) not in (0, 1, len(sources)):
        raise UserError(f"--eval_file names {len(files)} files for {len(sources)} --dataset sources; give one per "
                        f"source, in the same order, or one for all, or leave it out to hold out part of each")
    missing = [file for file in files if not Path(file).exists()]
    if missing:
        raise UserError(f"--eval_file {missing[0]} is not a file or folder here: pass the path of the held-out rows")
    return files


def mix_weights(text: str, count: int) -> list:
    """--mix_weights as shares that add up to 1 (None: no weights, the sources concatenated)."""
    if not text:
        return None
    if count == 1:
        raise UserError("--mix_weights weighs several --dataset sources (a,b,...); this run has one: leave it out")
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        raise UserError(f"--mix_weights {text!r}: give one number per --dataset source, in order, e.g. 2,1") from None
    if len(weights) != count:
        raise UserError(f"--mix_weights gives {len(weights)} weight(s) for {count} --dataset sources; give one per "
                        f"source, in order")
    if not all(w >= 0 and np.isfinite(w) for w in weights) or not sum(weights):
        raise UserError(f"--mix_weights {text!r}: the weights must be numbers of 0 or more, not all 0")
    return [w / sum(weights) for w in weights]


def row_order(settings: dict) -> dict:
    """What of a run's recorded settings decides the order of its training rows, as the run reads them: the seed
    (each epoch's shuffle, and the rows held out of a dataset without a validation split), the sources' shares (2,1
    draws as 4,2 does) and what they weigh where weighed, the buffer where streamed."""
    weights, streamed = settings.get("mix_weights", ""), settings.get("streaming", "off")
    shares = mix_weights(weights, len(weights.split(","))) if weights else None
    buffer = settings.get("shuffle_buffer", 10000) if streamed == "on" else None
    return {"seed": settings.get("seed", 42), "mix_weights": shares,
            "mix_by": settings.get("mix_by", "rows") if shares else None,
            "streaming": streamed, "shuffle_buffer": buffer}


class Mixture:
    """Each epoch's rows drawn from the sources by weight. An epoch keeps the length of all sources together (N
    rows); source i gives counts[i] of them: weights of rows, or of tokens (a source's rows then count by its mean
    row length). A source smaller than its share gives every row k times and a random draw of the rest; a larger one
    a random draw. Drawn anew each epoch from the seed and the epoch, then shuffled together: the same on every rank,
    whatever the world size, and again on a resume."""

    def __init__(self, sizes: list, tokens: list, weights: list, by: str, seed: int):
        self.sizes, self.seed = list(sizes), seed
        self.offsets = np.cumsum([0, *sizes])
        share = np.asarray(weights, dtype=np.float64)
        if by == "tokens":
            share = share * np.asarray(sizes) / np.asarray(tokens, dtype=np.float64)
        exact = share / share.sum() * sum(sizes)
        counts = np.floor(exact).astype(np.int64)
        counts[np.argsort(counts - exact, kind="stable")[:sum(sizes) - counts.sum()]] += 1  # largest remainders
        self.counts = counts.tolist()

    def order(self, epoch: int) -> list:
        rng = np.random.default_rng([self.seed, epoch])
        drawn = []
        for offset, size, count in zip(self.offsets, self.sizes, self.counts):
            whole, rest = divmod(count, size)
            drawn += [np.tile(np.arange(size), whole) + offset, rng.choice(size, rest, replace=False) + offset]
        drawn = np.concatenate(drawn)
        return drawn[rng.permutation(len(drawn))].tolist()

    def describe(self, names: list, by: str) -> str:
        """The line the run says once: each source's rows an epoch against its size."""
        def one(name, size, count):
            how = f"repeated, {count / size:.1f}x" if count > size else "none" if not count else \
                "sampled" if count < size else "each row once"
            return f"{name} {count:,} of its {size:,} ({how})"
        return f"mix by {by}: rows an epoch from " + "; ".join(map(one, names, self.sizes, self.counts)) + \
            "; drawn anew each epoch"


@dataclass
class Sources:
    """What the sampler and the log know of a set made of several sources: each one's name, where its rows start
    (offsets, with the total last), each row's tokens, the Mixture that draws the training order (None: each
    sample once an epoch), and with packing the rows of each block (a sample is then a block of rows)."""
    names: list
    offsets: list
    tokens: np.ndarray
    mixture: Mixture = None
    groups: list = None

    def counts(self, samples) -> tuple:
        """(rows, tokens) of each source among these samples."""
        rows = np.asarray(samples, dtype=np.int64)
        if self.groups is not None:
            rows = np.asarray([row for sample in rows for row in self.groups[sample]], dtype=np.int64)
        which = np.searchsorted(self.offsets, rows, side="right") - 1
        n = len(self.names)
        return np.bincount(which, minlength=n), np.bincount(which, weights=self.tokens[rows], minlength=n)

    def parts(self) -> list:
        """(name, first, end) of each source's rows."""
        return [(name, int(a), int(b)) for name, a, b in zip(self.names, self.offsets, self.offsets[1:])]
