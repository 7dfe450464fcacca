"""Streamed training text (docs/data-and-models.md, "Streaming"): `--streaming on` reads the training source as a
stream instead of loading and tokenizing it whole. Rows are read lazily (datasets' streaming mode), shuffled in a
buffer of --shuffle_buffer rows seeded by the seed and the pass, tokenized on the fly in the loader's worker, cut
into blocks (text) or rendered, labelled and packed or padded to the block (instruction data). The passes follow one
another as one endless sequence of samples, so the run counts --max_steps, every global micro batch is full and
every rank takes the same number of steps. Each rank reads the whole sequence and keeps its share of each global
micro batch, as the sampler of loaded data does; a resume reads the sequence again up to where the run stopped,
so it continues with exactly the batches it would have taken, on any world size."""
import functools
import itertools
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate

from app.data import DataInfo, chat, sources, text
from app.data.forms import block_for, instruction_form, kind_of
from app.data.samples import Samples, weights
from app.data.tokenizers import run_tokenizer
from app.distributed import dist
from app.errors import UserError, first_line

HEAD = 256  # samples read at start-up: the micro batch search's trials and the packing check draw on them
ENDLESS = 2 ** 62  # a streamed loader's length: the run ends at --max_steps


def read_rows(source: str, config: str, seed: int, buffer: int, one_pass: int, split: str = "train",
              eval_file: str = ""):
    """The rows of one pass over the source's split, read lazily, shuffled in a buffer of `buffer` rows (0: in file
    order) drawn from the seed and the pass; an --eval_file inside a plain folder is not among them."""
    import datasets
    datasets.disable_progress_bars()
    if text.saved_to_disk(Path(source)):
        raise UserError(f"--dataset {source} is a folder datasets' save_to_disk wrote, which loads whole: pass "
                        f"--streaming off")
    if Path(source).exists() and not text.names_splits(Path(source), eval_file):
        text.check_split(["train"], source, "--dataset_train_split", split)  # a plain file or folder is one split
        builder, files = text.local_files(Path(source), source)
        held = Path(eval_file).resolve() if eval_file and Path(source).is_dir() else None
        files = [f for f in files["train"] if Path(f).resolve() != held]
        if not files:
            raise UserError(f"--dataset {source} holds no data file besides --eval_file {eval_file}")
        streamed = functools.partial(datasets.load_dataset, builder, data_files=files, split="train", streaming=True)
    else:
        text.check_split(split_names(source, config), source, "--dataset_train_split", split)
        streamed = functools.partial(datasets.load_dataset, source, config or None, split=split, streaming=True)
    rows = _read(streamed, source, split)
    if buffer <= 0:
        yield from rows
        return
    rng = np.random.default_rng([seed, one_pass])
    held = list(itertools.islice(rows, buffer))
    for row in rows:
        slot = int(rng.integers(len(held)))
        yield held[slot]
        held[slot] = row
    for slot in rng.permutation(len(held)):
        yield held[slot]


def _read(streamed, source: str, split: str):
    """The rows of streamed(); a file it cannot open or parse, found as it is read (mid-run too), one line."""
    try:
        for row in streamed():
            yield row
    except UserError:
        raise
    except Exception as e:  # unreadable or malformed files, offline: many exception types
        raise UserError(f"cannot stream the {split!r} split of --dataset {source}: {first_line(e)}") from None


class Stream:
    """The endless sequence of training samples (input, labels, units) of a source: what every rank reads alike.
    kind: 'causal_lm' (blocks of text, `column`) or 'instruction' (rows of `form`, packed or padded to the block)."""

    def __init__(self, source: str, settings, tokenizer, kind: str, form: str, column: str, block: int,
                 packed: bool):
        self.source, self.config, self.seed, self.buffer = source, settings.dataset_config, settings.seed, \
            settings.shuffle_buffer
        self.split, self.eval_file = settings.dataset_train_split, settings.eval_file
        self.tokenizer, self.kind, self.form, self.column, self.block = tokenizer, kind, form, column, block
        self.packed, self.whole_text = packed, settings.train_on_prompt

    def samples(self):
        for one_pass in itertools.count():
            rows = read_rows(self.source, self.config, self.seed, self.buffer, one_pass, self.split, self.eval_file)
            made = self._blocks(rows) if self.kind == "causal_lm" else self._answers(rows, one_pass)
            first = next(made, None)
            if first is None:
                raise UserError(f"--dataset {self.source} gives no training sample of {self.block} tokens when "
                                f"streamed; add rows or lower --block_size")
            yield first
            yield from made

    def _blocks(self, rows):
        """Every text between the tokenizer's start tokens and the separator, concatenated and cut into blocks (the
        pass's tail left out), as text.lm_blocks makes them."""
        tokenizer = self.tokenizer
        sep = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
        carry, start = [], list(chat.start_ids(tokenizer))
        for row in rows:
            carry += start + tokenizer(row[self.column] or "", add_special_tokens=False)["input_ids"] + \
                ([sep] if sep is not None else [])
            while len(carry) >= self.block:
                ids = torch.tensor(carry[:self.block])
                carry = carry[self.block:]
                yield ids, ids, 1.0

    def _answers(self, rows, one_pass: int):
        """Rows rendered and labelled on their answers, cut to the block, padded or packed in order into blocks;
        rows left without an answer token are passed over."""
        pad, group, used = self.tokenizer.pad_token_id, [], 0
        for i, row in enumerate(rows):
            where = f"row {i} of pass {one_pass} over {self.source}"
            ids, labels, _, _ = chat.encode_row(self.tokenizer, row, self.form, where, self.block, self.whole_text)
            units = chat.answer_tokens(labels)
            if not units:
                continue
            if not self.packed:
                yield (*chat.padded(ids, labels, self.block, pad), float(units))
                continue
            if used + len(ids) > self.block:
                yield (*chat.packed_block([r for r, _ in group], self.block, pad), float(sum(u for _, u in group)))
                group, used = [], 0
            group.append(((ids, labels), units))
            used += len(ids)
        if group:
            yield (*chat.packed_block([r for r, _ in group], self.block, pad), float(sum(u for _, u in group)))


class Batches(IterableDataset):
    """This rank's micro batches (inputs, labels, weights) of the stream, from global micro batch `skip` on. Global
    micro batch g is samples g x B x W onwards; rank r takes every W-th of it. The weights make each optimizer
    step's loss the mean over the units of its window's samples on every rank (app/data/loader.py: ShardSampler),
    its window the `accumulation` global micro batches counted from `skip`, where DeepSpeed counts its micro steps
    from again (a resume at another world size or micro batch need not fall on a window of the first run)."""

    def __init__(self, stream: Stream, batch: int, rank: int, world: int, accumulation: int, skip: int):
        self.stream, self.batch, self.rank, self.world = stream, batch, rank, world
        self.accumulation, self.skip = accumulation, skip

    def __iter__(self):
        samples, span = self.stream.samples(), self.batch * self.world
        next(itertools.islice(samples, self.skip * span, self.skip * span), None)  # those trained before a resume
        while True:
            window = [list(itertools.islice(samples, span)) for _ in range(self.accumulation)]
            total = sum(units for chunk in window for _, _, units in chunk)
            for chunk in window:
                mine = chunk[self.rank::self.world]
                weighed = weights([units for _, _, units in mine], total, self.world, self.accumulation)
                yield default_collate([(x, y, torch.tensor(w, dtype=torch.float32))
                                       for (x, y, _), w in zip(mine, weighed)])


class StreamSet(Samples):
    """The training set of a streamed run: its stream, and the first HEAD samples as a set of its own (the micro
    batch search's trial steps; with packing, the rows of the packing check: rows)."""

    def __init__(self, stream: Stream):
        self.stream, self.block = stream, stream.block
        self.head = list(itertools.islice(stream.samples(), HEAD))
        self.units = [units for _, _, units in self.head]
        self.rows = _head_rows(stream) if stream.packed else None

    def __len__(self):
        return len(self.head)

    def __getitem__(self, i):
        return self.head[i][:2]


def _head_rows(stream: Stream):
    """The stream's first rows as AnswerRows (what app/core/packing.py's check packs)."""
    import datasets
    found = []
    for i, row in enumerate(read_rows(stream.source, stream.config, stream.seed, stream.buffer, 0, stream.split,
                                      stream.eval_file)):
        ids, labels, answer, _ = chat.encode_row(stream.tokenizer, row, stream.form, f"row {i}", stream.block,
                                                 stream.whole_text)
        if chat.answer_tokens(labels):
            found.append({"input_ids": ids, "labels": labels, "answer": answer, "units": chat.answer_tokens(labels)})
        if len(found) == 2:
            break
    return chat.AnswerRows(datasets.Dataset.from_list(found), stream.tokenizer.pad_token_id, stream.block)


class StreamLoader:
    """The training loader of a streamed run: one endless epoch (0), its position the global micro batches done
    (set_epoch's skip), read in at most one worker process so that the order stays one sequence. It answers the
    loop's calls as app/data/loader.py's ShardLoader does: set_epoch, drawn, total_units, micro_batch, len (ENDLESS)."""

    def __init__(self, stream: Stream, batch: int, rank: int, world: int, accumulation: int, workers: int,
                 pin: bool):
        self.stream, self.args, self.workers, self.pin = stream, (batch, rank, world, accumulation), workers, pin
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0):
        """Start at global micro batch `skip` of the one sequence (the epoch is always 0)."""
        self.skip = skip

    def drawn(self, epoch: int, done: int) -> dict:
        """One source: no per-source counts."""
        return {}

    def total_units(self) -> float:
        """Endless: the units of a stream have no total."""
        return float("inf")

    @property
    def micro_batch(self) -> int:
        """Samples in each of this rank's micro batches."""
        return self.args[0]

    def __len__(self):
        return ENDLESS

    def __iter__(self):
        return iter(DataLoader(Batches(self.stream, *self.args, self.skip), batch_size=None,
                               num_workers=min(self.workers, 1), pin_memory=self.pin))


def split_names(source: str, config: str) -> list:
    """The split names of a hub dataset or a local folder that names its splits."""
    import datasets
    try:
        return datasets.get_dataset_split_names(source, config or None)
    except Exception as e:  # a misspelt name, offline: many exception types
        raise UserError(f"--dataset {source!r} is not a local file or folder, nor a hub dataset whose splits can be "
                        f"listed: {first_line(e)}") from None


def _held_out(settings, source: str):
    """The held-out rows of a streamed run, loaded whole: --eval_file, else the dataset's --dataset_test_split,
    validation or test split (a hub dataset's, or a local folder's that names its splits)."""
    import datasets
    if settings.eval_file:
        file = sources.eval_files(settings.eval_file, [source])[0]
        return text.load_splits(file, "", "", settings.eval_fraction, settings.seed, hold_out=False)[0]
    if not Path(source).exists() or text.names_splits(Path(source)):
        splits = split_names(source, settings.dataset_config)
        training = settings.dataset_train_split or "train"  # never held out too
        text.check_held_out(settings.dataset_test_split, training)
        split = settings.dataset_test_split or next((s for s in text.HELD_OUT if s in splits and s != training), None)
        if split is not None:  # streamed and kept: loading the split alone would download every split
            text.check_split(splits, source, "--dataset_test_split", split)
            rows = datasets.load_dataset(source, settings.dataset_config or None, split=split, streaming=True)
            return datasets.Dataset.from_list(list(rows))
    raise UserError(f"--streaming on evaluates on held-out rows it can load whole: pass --eval_file (a local file of "
                    f"them), or a dataset with a validation or test split")


def _held_set(held, form: str, column: str, tokenizer, block: int, packed: bool, settings):
    """The held-out rows of a streamed run tokenized as when loaded: instruction rows (packed when the training
    is), or blocks of text."""
    if form:
        rows = text.instruction_rows(held, tokenizer, form, block, settings.train_on_prompt, "held-out")
        held_set = chat.AnswerRows(rows, tokenizer.pad_token_id, text.longest(rows))
        return chat.PackedRows(held_set, block) if packed else held_set
    blocks = text.lm_blocks(held, tokenizer, column, block, "held-out")
    if not len(blocks):
        raise UserError(f"the held-out text is shorter than one block of {block} tokens; lower --block_size or add "
                        f"held-out text")
    return text.Rows(blocks, tokenizer.pad_token_id)


def build(settings, model, task: str, output_dir):
    """(train, held-out, DataInfo, tokenizer, task) of a streamed run: the training set a StreamSet, the held-out
    set loaded and tokenized as for any run; the tokenizer's texts and the rows' form from the first rows."""
    import datasets
    if len(sources.split_sources(settings.dataset)) > 1:
        raise UserError("--streaming on reads one --dataset source; mix several with it off")
    sources.mix_weights(settings.mix_weights, 1)  # refused: nothing to weigh
    with dist.main_process_first():
        held = _held_out(settings, settings.dataset)
        first = datasets.Dataset.from_list(list(itertools.islice(read_rows(
            settings.dataset, settings.dataset_config, 0, 0, 0, settings.dataset_train_split, settings.eval_file),
            10000)))
        form, held_form = instruction_form(first, task, settings), instruction_form(held, task, settings)
        kind_of([form, held_form], [settings.dataset], task)
        if form in ("explicit", "implicit") or task == "sequence_classification":
            raise UserError("--streaming on streams text and instruction data; preference pairs and labelled rows "
                            "load whole: pass --streaming off")
        column = "" if form else text.pick_column(first, settings.text_column, "text", ("text",))
        if column and column not in held.column_names:
            raise UserError(f"--eval_file {settings.eval_file} has no {column!r} column, which the training text is "
                            f"in; its columns are: {', '.join(held.column_names)}")
        texts = (lambda: text.chat_texts(first, form)) if form else (lambda: iter([first[column]]))
        tokenizer = run_tokenizer(settings, model, texts, output_dir, chat=bool(form))
        block, packed = block_for(settings, model, tokenizer), bool(form) and settings.packing != "off"
        if not form and settings.packing == "on":
            raise UserError("--packing on packs instruction data (rows of 'messages', or 'prompt' and 'completion'); "
                            "blocks of text are packed already; leave --packing auto")
        held_set = _held_set(held, held_form, column, tokenizer, block, packed, settings)
    train_set = StreamSet(Stream(settings.dataset, settings, tokenizer, "instruction" if form else "causal_lm", form,
                                 column, block, packed))
    dist.print0(f"train: streamed from {settings.dataset} ({'packed into ' if packed else ''}blocks of {block} "
                f"tokens, a shuffle buffer of {settings.shuffle_buffer} rows)")
    info = DataInfo(0, task="causal_lm", vocab_size=len(tokenizer), seq_len=block, packed=packed)
    return train_set, held_set, info, tokenizer, "instruction" if form else task
