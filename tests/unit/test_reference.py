"""The precomputed reference's file: keyed by the data, the base model and the precision, kept beside the tokenized
pairs (else in the output folder), computed once and read after."""
import types
from pathlib import Path

import datasets
import torch

from app.core import reference
from app.core.preference import answer_logps
from app.data import chat, preference
from app.data.tokenizers import byte_tokenizer
from conftest import REPO

ROWS = [{"prompt": f"Is {n} odd?", "chosen": f" {'yes' if n % 2 else 'no'}", "rejected": f" {'no' if n % 2 else 'yes'}"}
        for n in range(5)]


def pairs_of(rows) -> preference.PairRows:
    tok = byte_tokenizer()
    chat.ensure_template(tok)
    encoded = rows.map(preference.encoder(tok, 64, "train"), batched=True, with_indices=True,
                       remove_columns=rows.column_names)
    return preference.PairRows(encoded, tok.pad_token_id, 64)


def test_the_key_changes_with_the_data_the_base_and_the_precision():
    a, b = pairs_of(datasets.Dataset.from_list(ROWS)), pairs_of(datasets.Dataset.from_list(ROWS[:3]))
    key = reference._key([a, b], "base-1", torch.bfloat16)
    assert len(key) == 24 and int(key, 16) >= 0
    assert reference._key([a, b], "base-1", torch.bfloat16) == key, "the same inputs, the same file"
    others = {reference._key([b, a], "base-1", torch.bfloat16), reference._key([a, b], "base-2", torch.bfloat16),
              reference._key([a, b], "base-1", torch.float32), reference._key([a], "base-1", torch.bfloat16)}
    assert key not in others and len(others) == 4


def test_the_file_sits_beside_the_cached_pairs_else_in_the_output_folder(tmp_path):
    data = REPO / "tests" / "data" / "preference" / "trl-zen-standard_explicit.jsonl"
    cached = pairs_of(datasets.load_dataset("json", data_files=str(data), split="train"))
    in_memory = pairs_of(datasets.Dataset.from_list(ROWS))
    path = reference._place([cached, in_memory], tmp_path, "abc")
    assert path.name == "reference-logps-abc.json"
    assert path.parent == Path(cached.dataset.cache_files[0]["filename"]).parent
    assert path.parent != tmp_path
    assert reference._place([in_memory, cached], tmp_path, "abc") == tmp_path / "reference-logps-abc.json"


class TinyReference:
    """A fixed random bigram model's log-probabilities of the answers, as app.core.reference.Reference gives; each
    rank its own share of the pairs, as a Reference without sequence parallelism."""
    share = reference.Reference.share
    group = None

    def __init__(self):
        self.engine = types.SimpleNamespace(device=torch.device("cpu"))
        self.table = torch.randn(258, 258, generator=torch.Generator().manual_seed(0))

    def __call__(self, ids, labels):
        return answer_logps(self.table[ids], labels)[:, 0]


def test_precompute_computes_once_writes_and_reads_the_same_values_after(tmp_path, capsys):
    train, held = pairs_of(datasets.Dataset.from_list(ROWS)), pairs_of(datasets.Dataset.from_list(ROWS[:2]))
    model, calls = TinyReference(), []
    reference_of = lambda: calls.append(1) or model  # noqa: E731
    reference.precompute(reference_of, [train, held], "base", torch.float32, 2, tmp_path)
    path = tmp_path / reference.FILE.format(reference._key([train, held], "base", torch.float32))
    assert calls == [1] and path.is_file() and "computed once and kept in" in capsys.readouterr().out
    for pairs in (train, held):
        direct = torch.stack([model(ids, labels) for ids, (labels, _) in (pairs[i] for i in range(len(pairs)))])
        assert pairs.reference.shape == (len(pairs), 2) and torch.allclose(pairs.reference, direct)
        assert torch.equal(pairs[1][1][1], pairs.reference[1])
    first = train.reference.clone()
    again = pairs_of(datasets.Dataset.from_list(ROWS))
    reference.precompute(reference_of, [again, held], "base", torch.float32, 2, tmp_path)
    assert calls == [1] and "read from" in capsys.readouterr().out and torch.equal(again.reference, first)
