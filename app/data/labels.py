"""Labelled text for sequence classification: a label column's classes and their names (which the model's head and
its exported config carry, in a pretrained head's order where its names are the data's), one text column a row or
a pair of them (GLUE's sentence1 and sentence2), each row tokenized with its class."""
from app.distributed import dist
from app.data import text
from app.errors import UserError

PAIRS = (("sentence1", "sentence2"), ("premise", "hypothesis"), ("question1", "question2"), ("question", "sentence"))
"""The columns of a pair of texts, as transformers' run_glue names them (MRPC, RTE, STS-B; MNLI, SNLI; QQP; QNLI)."""
UNLABELLED = -1  # a ClassLabel's value for a row without a label (SNLI's, a GLUE test split's)


def text_columns(dataset, wanted: str) -> str:
    """The text column, or two joined by a comma (--text_column a,b, or a pair PAIRS names where no 'text' is)."""
    if "," in wanted:
        if wanted.count(",") > 1 or not all(name.strip() for name in wanted.split(",")):
            raise UserError(f"--text_column {wanted!r}: a classifier reads one text a row or a pair of them (a,b)")
        for name in wanted.split(","):
            text.pick_column(dataset, name, "text", ())
        return wanted
    columns = dataset.column_names
    pair = next((a, b) for a, b in PAIRS + ((None, None),) if a is None or (a in columns and b in columns))
    if wanted or "text" in columns or pair[0] is None:
        return text.pick_column(dataset, wanted, "text", ("text",))
    return ",".join(pair)


def label_names(dataset, column: str) -> list:
    """The classes in order: a ClassLabel's indices, 0..max for whole numbers (the values in order where one is
    below 0), sorted values otherwise; one line for labels that are not one class a row."""
    from datasets import ClassLabel, Value
    feature = dataset.features[column]
    if isinstance(feature, ClassLabel):
        return list(range(len(feature.names)))
    values = dataset.unique(column) if isinstance(feature, Value) else [[]]  # a list or a mapping a row
    if None in values or any(isinstance(v, (list, dict)) for v in values):
        raise UserError(f"--label_column {column!r} holds empty values or several labels a row; every row needs "
                        f"one label (multi-label classification is not trained here)")
    if any(isinstance(v, float) and not v.is_integer() for v in values):
        raise UserError(f"--label_column {column!r} holds scores such as {next(v for v in values if v % 1)!r}, a "
                        f"regression target: this app trains classifiers, one class a distinct label; pass whole "
                        f"numbers or names")
    if values and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        values = sorted({int(v) for v in values})
        return list(range(values[-1] + 1)) if values[0] >= 0 else values
    return sorted(set(values), key=str)


def classes(trains: list, columns: list) -> tuple:
    """(the classes of every source together, their names): label_names of each, merged; ClassLabel sources must
    agree on their names, which their labels index, and no source may give numbers where another gives names."""
    from datasets import ClassLabel
    names = [train.features[label].names if isinstance(train.features[label], ClassLabel) else None
             for train, label in zip(trains, columns)]
    if any(names) and (None in names or any(n != names[0] for n in names)):
        raise UserError("the --dataset sources' labels differ in kind or order (ClassLabel names: " + "; ".join(
            ", ".join(n) if n else "plain values" for n in names) + "); give every source the same labels")
    found = [label_names(train, label) for train, label in zip(trains, columns)]
    kinds = {isinstance(v, int) for values in found for v in values}
    if len(kinds) > 1:
        raise UserError("the --dataset sources' labels differ in kind: numbers in one, names in another; give "
                        "every source the same labels")
    if kinds == {True} and not any(v < 0 for values in found for v in values):
        merged = list(range(max(len(values) for values in found)))
    else:
        merged = sorted({v for values in found for v in values}, key=str if kinds == {False} else None)
    return merged, [names[0][v] for v in merged] if names[0] else [str(v) for v in merged]


def head_names(config, pretrained: str) -> tuple:
    """A pretrained classifier's label names in its head's order; () where it has no head or its config gives only
    transformers' defaults (LABEL_0, ...)."""
    named = getattr(config, "id2label", None) or {}
    names = tuple(str(named[i]) for i in sorted(named))
    return names if pretrained and names != tuple(f"LABEL_{i}" for i in range(len(names))) else ()


def in_head_order(merged: list, named: list, head: tuple) -> tuple:
    """(classes, names) in the order of a pretrained head whose label names are the data's, matched without case
    (as run_glue matches them), so that each class keeps the head's row trained for it; else as they are."""
    if not head or sorted(n.lower() for n in named) != sorted(n.lower() for n in head):
        return merged, named
    at = {name.lower(): i for i, name in enumerate(named)}
    order = [at[name.lower()] for name in head]
    return [merged[i] for i in order], [named[i] for i in order]


def labelled_rows(dataset, tokenizer, column: str, label_column: str, labels: list, block_size: int, what: str):
    """Each text (or pair of texts: column 'a,b') tokenized, truncated to block_size, with its label's index in
    labels; rows a ClassLabel marks unlabelled (UNLABELLED) are left out, and said."""
    from datasets import ClassLabel
    index = {label: i for i, label in enumerate(labels)}
    unlabelled = UNLABELLED if isinstance(dataset.features[label_column], ClassLabel) else object()
    first, *second = column.split(",")

    def encode(batch):
        kept = [i for i, y in enumerate(batch[label_column]) if y != unlabelled]
        unknown = [batch[label_column][i] for i in kept if batch[label_column][i] not in index]
        if None in unknown:
            raise UserError(f"--label_column {label_column!r} of the {what} rows holds empty values; every row needs "
                            f"one label")
        if unknown:
            raise UserError(f"the {what} label {unknown[0]!r} never occurs in the training data")
        texts = [[batch[name][i] or "" for i in kept] for name in [first, *second]]
        ids = tokenizer(*texts, truncation=True, max_length=block_size)["input_ids"] if kept else []
        return {"input_ids": ids, "target": [index[batch[label_column][i]] for i in kept]}
    rows = text.mapped(dataset, encode, text.cache_key(dataset, tokenizer, "cls", column, label_column, labels,
                                                       block_size), what, "labelled rows")
    if len(rows) < len(dataset):
        dist.print0(f"{what}: {len(dataset) - len(rows)} rows have no label ({UNLABELLED}) and are left out")
    if not len(rows):
        raise UserError(f"no {what} row has a label ({UNLABELLED} in every one): hold out labelled rows "
                        f"(--dataset_test_split, --eval_file)")
    return rows
