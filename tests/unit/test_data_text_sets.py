"""The sets of a transformers model from several text sources (app/data/text_sets.py): each source tokenized in its
own form and concatenated, its held-out part kept apart for its own evaluation, the mixture drawn by its weights;
one held-out file for all; mistakes in one line."""
import json

import numpy as np
import pytest

from app.data import TextModel, text_sets
from app.errors import UserError
from app.settings import Settings
from conftest import write_text_rows

MODEL = TextModel("", 8192, 128)


def _chats(path, n):
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {i}."},
                                                    {"role": "assistant", "content": f"{i}"}]}) + "\n"
                            for i in range(n)))
    return path


def _alpaca(path, n):
    path.write_text("".join(json.dumps({"instruction": f"Add {i} and 1.", "input": "", "output": f"{i + 1}"}) + "\n"
                            for i in range(n)))
    return path


def _build(tmp_path, **given):
    settings = Settings(model="llama-tiny", tokenizer="bytes", **given)
    return text_sets.build_text_sets(settings, MODEL, "causal_lm", tmp_path / "run")


def test_two_forms_are_one_instruction_set_each_source_held_out_apart_and_mixed(tmp_path, capsys):
    chats, alpaca = _chats(tmp_path / "chats.jsonl", 100), _alpaca(tmp_path / "alpaca.jsonl", 40)
    train, held, info, _, kind = _build(tmp_path, dataset=f"{chats},{alpaca}", mix_weights="1,1",
                                        mix_by="tokens", eval_fraction=0.25)
    said = capsys.readouterr().out
    assert kind == "instruction" and not info.packed and "packing: off: --mix_weights draws" in said
    assert "train chats: 75 rows" in said and "held-out alpaca: 10 rows" in said
    assert train.sources.names == ["chats", "alpaca"] and train.sources.offsets == [0, 75, 105]
    assert held.sources.parts() == [("chats", 0, 25), ("alpaca", 25, 35)]
    assert train.sources.tokens[0] == len(train.dataset[0]["input_ids"]) and train.sources.tokens[80] > 0
    counts, tokens = train.sources.mixture.counts, train.sources.tokens
    per_row = [tokens[:75].mean(), tokens[75:].mean()]
    assert abs(counts[0] * per_row[0] - counts[1] * per_row[1]) <= max(per_row)  # equal tokens, to a row
    assert f"mix by tokens: rows an epoch from chats {counts[0]} of its 75" in said


def test_without_weights_the_sources_pack_together_and_one_held_out_file_serves_all(tmp_path, capsys):
    chats, alpaca = _chats(tmp_path / "chats.jsonl", 60), _alpaca(tmp_path / "alpaca.jsonl", 30)
    held_file = _alpaca(tmp_path / "held.jsonl", 12)
    train, held, info, _, _ = _build(tmp_path, dataset=f"{chats},{alpaca}", eval_file=str(held_file))
    assert info.packed and train.sources.mixture is None and train.sources.groups is train.groups
    assert len(train.rows) == 90 and len(held.rows) == 12 and held.sources is None
    rows, _ = train.sources.counts(range(len(train)))
    assert rows.tolist() == [60, 30]  # every block once: every row of each source once


def test_plain_text_sources_make_blocks_and_count_them(tmp_path):
    one, two = write_text_rows(tmp_path / "one.txt", 300), write_text_rows(tmp_path / "two.txt", 100, seed=1)
    train, held, info, _, kind = _build(tmp_path, dataset=f"{one},{two}", block_size=32, mix_weights="3,1")
    assert kind == "causal_lm" and info.seq_len == 32
    assert np.all(train.sources.tokens == 32) and sum(train.sources.mixture.counts) == len(train)
    assert [name for name, _, _ in held.sources.parts()] == ["one", "two"]


@pytest.mark.parametrize("given, says", [
    ({"mix_weights": "1,1", "packing": "on"}, "--packing on packs the rows once before training, and --mix_weights"),
    ({"mix_weights": "1"}, "--mix_weights gives 1 weight\\(s\\) for 2 --dataset sources"),
    ({"eval_file": "a.jsonl,b.jsonl,c.jsonl"}, "--eval_file names 3 files for 2 --dataset sources"),
])
def test_mistakes_are_one_line(tmp_path, given, says):
    chats, alpaca = _chats(tmp_path / "chats.jsonl", 20), _alpaca(tmp_path / "alpaca.jsonl", 20)
    with pytest.raises(UserError, match=says):
        _build(tmp_path, dataset=f"{chats},{alpaca}", **given)


def test_sources_of_different_kinds_are_refused(tmp_path):
    chats, text = _chats(tmp_path / "chats.jsonl", 20), write_text_rows(tmp_path / "plain.txt", 50)
    with pytest.raises(UserError, match="different kinds of rows \\(chats: instruction data, plain: text\\)"):
        _build(tmp_path, dataset=f"{chats},{text}")
