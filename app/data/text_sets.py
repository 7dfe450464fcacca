"""The training and held-out sets of a transformers model, from one text source or several (app/data/sources.py):
each source loaded, its form found (plain text, labelled text, instruction data, preference pairs), tokenized on the
main rank first and cached; several sources concatenated, mixed by weight when asked, evaluated each on its own."""
from pathlib import Path

import numpy as np

from app.data import DataInfo, TextModel, chat, labels, preference, prompts, sources, stream, text
from app.data.forms import block_for, instruction_form, kind_of
from app.data.tokenizers import run_tokenizer
from app.distributed import dist
from app.errors import UserError
from app.settings import Settings


def instruction_sets(train, eval_set, tokenizer, block: int, packing: str, pack_held: bool = True) -> tuple:
    """(train, held-out, DataInfo) of tokenized instruction rows: padded to the longest kept, or packed into blocks
    unless --packing is off (the held-out rows too, unless pack_held is False: evaluated per source, row by row)."""
    length = max(text.longest(train), text.longest(eval_set))
    sets = [chat.AnswerRows(rows, tokenizer.pad_token_id, length) for rows in (train, eval_set)]
    packed = packing != "off"
    if packed:
        sets = [chat.PackedRows(sets[0], block), chat.PackedRows(sets[1], block) if pack_held else sets[1]]
        dist.print0(f"packing: {len(sets[0].rows)} rows into {len(sets[0])} blocks of {block} tokens, "
                    f"{sum(len(ids) for ids in train['input_ids']) / (len(sets[0]) * block):.0%} full")
    info = DataInfo(0, task="causal_lm", vocab_size=len(tokenizer), seq_len=block if packed else length,
                    packed=packed)
    return (*sets, info)


def _lengths(rows, *columns) -> np.ndarray:
    """Each row's tokens: the lengths of its token columns added up."""
    return sum(chat.token_counts(rows, c).astype(np.float64) for c in columns)


def _joined(parts: list):
    """(one dataset, where each part starts, the total last) of tokenized parts."""
    import datasets
    offsets = np.cumsum([0, *map(len, parts)]).tolist()
    return (parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)), offsets


def _load(settings: Settings, listed: list) -> tuple:
    """([(train, held-out or None)] of each source, the held-out set of all of them or None): each source's own
    held-out split or --eval_file, or one --eval_file for every source."""
    files = sources.eval_files(settings.eval_file, listed)
    shared = len(listed) > 1 and len(files) == 1
    loaded = [text.load_splits(source, settings.dataset_config, "" if shared or not files else files[i],
                               settings.eval_fraction, settings.seed, hold_out=not shared,
                               splits_named=(settings.dataset_train_split, settings.dataset_test_split))
              for i, source in enumerate(listed)]
    return loaded, text.load_splits(files[0], "", "", 0.1, 0, hold_out=False)[0] if shared else None


def _packing(settings: Settings, kind: str, weights) -> str:
    """--packing as this run takes it: off where weights draw the rows anew each epoch (auto), refused where on."""
    if kind not in ("instruction", "preference") and settings.packing == "on":
        raise UserError("--packing on packs instruction data (rows of 'messages', or 'prompt' and 'completion'); "
                        "blocks of text are packed already; leave --packing auto")
    if not (weights and kind == "instruction" and settings.packing != "off"):
        return settings.packing
    if settings.packing == "on":
        raise UserError("--packing on packs the rows once before training, and --mix_weights draws them anew each "
                        "epoch; pass --packing off, or leave the weights out to pack every row")
    dist.print0("packing: off: --mix_weights draws the rows anew each epoch, and packing groups them once, before "
                "training")
    return "off"


def _encoder(kind: str, tokenizer, block: int, settings: Settings, trains: list, head: tuple):
    """encode(data, form, column, what): the tokenized rows of one source's split, as its kind tokenizes them; and
    the names of the classes (labelled text: in the order of head, a pretrained head's names, where they match) or
    None."""
    classes, names = None, None

    def label(data):
        return text.pick_column(data, settings.label_column, "label", ("label", "labels"))
    if kind == "sequence_classification":
        classes, names = labels.in_head_order(*labels.classes(trains, [label(train) for train in trains]), head)
        if len(classes) < 2:
            raise UserError(f"--label_column {label(trains[0])!r} has a single class; classification needs two or more")

    def encode(data, form, column, what):
        if kind == "preference":
            return preference.pair_rows(data, tokenizer, block, what)
        if kind == "instruction":
            return text.instruction_rows(data, tokenizer, form, block, settings.train_on_prompt, what)
        if kind == "sequence_classification":
            return labels.labelled_rows(data, tokenizer, column, label(data), classes, block, what)
        blocks = text.lm_blocks(data, tokenizer, column, block, what)
        if not len(blocks):
            raise UserError(f"the {what} text is shorter than one block of {block} tokens; lower --block_size or "
                            f"add text")
        return blocks
    return encode, names


def _sets(kind: str, train, held, tokenizer, block: int, settings: Settings, packing: str, pack_held: bool,
          names) -> tuple:
    """(train set, held-out set, DataInfo) of the tokenized rows, as the kind trains on them."""
    if kind == "preference":
        return preference.pair_sets(train, held, tokenizer, block, settings)
    if kind == "instruction":
        return instruction_sets(train, held, tokenizer, block, packing, pack_held)
    length = max(text.longest(train), text.longest(held), 1) if names else 0
    return (text.Rows(train, tokenizer.pad_token_id, length), text.Rows(held, tokenizer.pad_token_id, length),
            DataInfo(len(names or ()), task=kind, vocab_size=len(tokenizer), seq_len=length or block,
                     labels=tuple(names or ())))


def _tell_sources(made: tuple, kind: str, names: list, train, train_at, held, held_at, weights, settings):
    """With several sources: the training set's Sources (and Mixture with weights), the held-out set's when each
    source has its own part."""
    train_set, held_set, info = made
    counted = ("chosen", "rejected") if kind == "preference" else ("input_ids",)
    if len(names) > 1:
        tokens, mixture = _lengths(train, *counted), None
        if weights:
            mixture = sources.Mixture(np.diff(train_at).tolist(), [tokens[a:b].sum() for a, b in
                                                                   zip(train_at, train_at[1:])],
                                      weights, settings.mix_by, settings.seed)
            dist.print0(mixture.describe(names, settings.mix_by))
        train_set.sources = sources.Sources(names, train_at, tokens, mixture,
                                            train_set.groups if info.packed else None)
    if len(held_at) > 2:
        held_set.sources = sources.Sources(names, held_at, _lengths(held, *counted))


def build_text_sets(settings: Settings, model: TextModel, task: str, output_dir: Path):
    """(train, held-out, DataInfo, tokenizer, task) for a transformers model, tokenized on the main rank first.
    task: the one asked for; causal_lm becomes instruction when the rows hold chats or prompts and completions."""
    if task == "grpo":  # prompts alone: the completions are sampled while training
        return prompts.prompt_sets(settings, model, output_dir)
    if settings.streaming == "on":
        return stream.build(settings, model, task, output_dir)
    listed = sources.split_sources(settings.dataset)
    names, several = sources.source_names(listed), len(listed) > 1
    weights = sources.mix_weights(settings.mix_weights, len(listed))
    with dist.main_process_first():
        loaded, shared = _load(settings, listed)
        trains = [train for train, _ in loaded]
        read = trains + ([shared] if shared else [])
        forms = [instruction_form(data, task, settings) for data in read]
        kind = kind_of(forms, names, task)
        pick = labels.text_columns if kind == "sequence_classification" else \
            (lambda data, wanted: text.pick_column(data, wanted, "text", ("text",)))
        columns = ["" if form else pick(data, settings.text_column) for data, form in zip(read, forms)]

        def texts():
            for data, form, column in zip(trains, forms, columns):
                yield from text.chat_texts(data, form) if form else \
                    ([t for name in column.split(",") for t in batch[name]] for batch in data.iter(batch_size=1000))
        tokenizer = run_tokenizer(settings, model, texts, output_dir, chat=bool(forms[0]))
        block = block_for(settings, model, tokenizer)
        packing = _packing(settings, kind, weights)
        encode, class_names = _encoder(kind, tokenizer, block, settings, trains, model.labels)
        named = [f"{{}} {name}" if several else "{}" for name in names]
        train, train_at = _joined([encode(data, form, column, n.format("train"))
                                   for data, form, column, n in zip(trains, forms, columns, named)])
        held, held_at = _joined([encode(data, form, column, n.format("held-out")) for (_, data), form, column, n in
                                 zip(loaded, forms, columns, named)] if shared is None else
                                [encode(shared, forms[-1], columns[-1], "held-out")])
        made = _sets(kind, train, held, tokenizer, block, settings, packing, len(held_at) == 2, class_names)
    _tell_sources(made, kind, names, train, train_at, held, held_at, weights, settings)
    return (*made, tokenizer, kind)
