"""Streamed training text (app/data/stream.py): rows read lazily and shuffled in a buffer per pass, blocks and
packed or padded instruction rows made on the fly, every rank's exclusive share of each global micro batch with the
loaded sampler's weights, a resume's skip, and the refusals."""
import itertools
import json
import math

import pytest
import torch

from app.data import TextModel, chat, loader, stream, text_sets
from app.data.tokenizers import byte_tokenizer
from app.errors import UserError
from app.settings import Settings
from conftest import write_text_rows


def _chats(path, n):
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {i}."},
                                                    {"role": "assistant", "content": f"{i} " * (i % 7 + 1)}]}) + "\n"
                            for i in range(n)))
    return path


def _stream(path, kind, form="", column="", block=32, packed=False, buffer=8):
    tokenizer = byte_tokenizer()
    chat.ensure_template(tokenizer)
    settings = Settings(model="llama-tiny", shuffle_buffer=buffer, seed=3)
    return stream.Stream(str(path), settings, tokenizer, kind, form, column, block, packed)


def test_a_pass_is_every_row_once_shuffled_by_the_seed_and_the_pass(tmp_path):
    path = _chats(tmp_path / "chats.jsonl", 40)
    one = [row["messages"][0]["content"] for row in stream.read_rows(str(path), "", 3, 8, 0)]
    again = [row["messages"][0]["content"] for row in stream.read_rows(str(path), "", 3, 8, 0)]
    other = [row["messages"][0]["content"] for row in stream.read_rows(str(path), "", 3, 8, 1)]
    in_order = [row["messages"][0]["content"] for row in stream.read_rows(str(path), "", 3, 0, 0)]
    assert sorted(one) == sorted(other) == sorted(in_order) and len(one) == 40
    assert one == again and one != other and in_order == [f"Say {i}." for i in range(40)]


def test_text_becomes_blocks_pass_after_pass(tmp_path):
    path = write_text_rows(tmp_path / "corpus.txt", 30)
    made = _stream(path, "causal_lm", column="text", buffer=0)
    samples = list(itertools.islice(made.samples(), 200))
    ids, labels, units = samples[0]
    assert ids.shape == (32,) and torch.equal(ids, labels) and units == 1.0
    tok = made.tokenizer
    tokens = [t for line in path.read_text().splitlines()
              for t in [*tok(line, add_special_tokens=False)["input_ids"], tok.eos_token_id]]
    assert [s[0].tolist() for s in samples[:3]] == [tokens[k * 32:(k + 1) * 32] for k in range(3)]
    per_pass = len(tokens) // 32
    assert torch.equal(samples[0][0], samples[per_pass][0])  # in file order, the next pass starts over


@pytest.mark.parametrize("packed", [False, True])
def test_instruction_rows_are_padded_or_packed_and_count_their_answer_tokens(tmp_path, packed):
    path = _chats(tmp_path / "chats.jsonl", 20)
    made = _stream(path, "instruction", form="messages", block=64, packed=packed, buffer=0)
    first = list(itertools.islice(made.samples(), 5))
    if not packed:
        ids, labels, units = first[0]
        assert ids.shape == labels.shape == (64,) and units == chat.answer_tokens(labels.tolist())
        return
    (ids, positions), labels, units = first[0]
    assert ids.shape == positions.shape == (64,) and (positions == 0).sum() >= 2, "several rows in a block"
    assert units == (labels != chat.IGNORE).sum().item()


@pytest.mark.parametrize("world, accumulation", [(1, 1), (2, 1), (2, 3), (3, 2)])
def test_ranks_take_exclusive_equal_shares_weighed_as_the_loaded_sampler_does(tmp_path, world, accumulation):
    path = _chats(tmp_path / "chats.jsonl", 23)
    made = _stream(path, "instruction", form="messages", block=64)
    per_rank = [list(itertools.islice(iter(stream.Batches(made, 2, rank, world, accumulation, 0)), 6))
                for rank in range(world)]
    sequence = list(itertools.islice(made.samples(), 2 * world * 6))
    for g in range(6):
        chunk = sequence[g * 2 * world:(g + 1) * 2 * world]
        window = sequence[g // accumulation * accumulation * 2 * world:][:accumulation * 2 * world]
        total = sum(units for _, _, units in window)
        for rank in range(world):
            ids, _, weights = per_rank[rank][g]
            mine = chunk[rank::world]
            assert torch.equal(ids, torch.stack([x for x, _, _ in mine]))
            expected = torch.tensor([world * accumulation * u / total for _, _, u in mine])
            assert torch.allclose(weights, expected)


def test_a_resume_skips_the_global_micro_batches_done(tmp_path):
    """At a step's end of the same layout the resumed batches are the unbroken run's, weights too. Where a resume
    at another layout starts inside a window the first run had (micro batch 5 of windows of 2), DeepSpeed counts
    its windows from there: each pair from there weighs W x A over the ranks."""
    made = _stream(_chats(tmp_path / "chats.jsonl", 30), "instruction", form="messages", block=64)
    whole = list(itertools.islice(iter(stream.Batches(made, 2, 1, 2, 2, 0)), 12))
    resumed = list(itertools.islice(iter(stream.Batches(made, 2, 1, 2, 2, 4)), 8))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[2], b[2]) for a, b in zip(whole[4:], resumed))
    inside = [list(itertools.islice(iter(stream.Batches(made, 2, rank, 2, 2, 5)), 6)) for rank in range(2)]
    assert torch.equal(inside[1][0][0], whole[5][0])
    for first in range(0, 6, 2):
        total = sum(float(batches[k][2].sum()) for batches in inside for k in (first, first + 1))
        assert total == pytest.approx(4.0), first


def test_the_streamed_and_the_loaded_loader_answer_the_loops_calls_alike(tmp_path):
    """The loop drives either loader alike: set_epoch(epoch, skip) starts at global micro batch skip, drawn is
    empty with one source, total_units weighs an evaluation, len counts an epoch's micro batches."""
    train = stream.StreamSet(_stream(_chats(tmp_path / "chats.jsonl", 30), "instruction", form="messages", block=64))
    loaded = loader.build_loader(train, 2, 1, 2, True, 0, accumulation=2)
    streamed = loader.training_loader(train, 2, 1, 2, 0, accumulation=2)
    assert isinstance(loaded, loader.ShardLoader) and isinstance(streamed, stream.StreamLoader)
    for each in (loaded, streamed):
        each.set_epoch(0)
        whole = list(itertools.islice(iter(each), 6))
        each.set_epoch(0, 4)  # a step's end: windows of 2
        resumed = list(itertools.islice(iter(each), 2))
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[2], b[2]) for a, b in zip(whole[4:], resumed))
        assert not torch.equal(whole[0][0], resumed[0][0]) and each.drawn(0, 3) == {}
    assert loaded.total_units() == sum(train.units) and streamed.total_units() == math.inf
    assert len(loaded) == math.ceil(stream.HEAD / 4) and len(streamed) == stream.ENDLESS
    assert loader.feeding(train, cuda=True, cores_per_rank=8) == (1, True), "one sequence: one reader"


def test_streamed_sets_refuse_what_they_cannot_stream(tmp_path):
    chats = _chats(tmp_path / "chats.jsonl", 20)
    with pytest.raises(UserError, match="--streaming on reads the data pass after pass.*set --max_steps"):
        Settings(model="llama-tiny", streaming="on")

    def build(**given):
        settings = Settings(model="llama-tiny", tokenizer="bytes", streaming="on", max_steps=2, **given)
        return text_sets.build_text_sets(settings, TextModel("", 8192, 128), "causal_lm", tmp_path / "run")
    with pytest.raises(UserError, match="held-out rows it can load whole: pass --eval_file"):
        build(dataset=str(chats))
    with pytest.raises(UserError, match="different kinds of rows"):
        build(dataset=str(chats), eval_file=str(write_text_rows(tmp_path / "held.txt", 20)))
    with pytest.raises(UserError, match="--mix_weights weighs several --dataset sources"):
        build(dataset=str(chats), eval_file=str(chats), mix_weights="1")
    with pytest.raises(UserError, match="reads one --dataset source"):
        build(dataset=f"{chats},{chats}", eval_file=str(chats))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    with pytest.raises(UserError, match="preference pairs and labelled rows load whole"):
        build(dataset=str(pairs), eval_file=str(pairs))
    alpaca = tmp_path / "alpaca.jsonl"  # held-out rows of another form of instruction data
    alpaca.write_text("".join(json.dumps({"instruction": f"Add {i}.", "output": f"{i}"}) + "\n" for i in range(20)))
    train, held, info, _, kind = build(dataset=str(chats), eval_file=str(alpaca), packing="off")
    assert kind == "instruction" and info.seq_len == 128 and not info.packed and len(held) == 20
    assert len(train) == stream.HEAD and train.stream is not None and train[0][0].shape == (128,)


def test_a_damaged_file_or_a_wrong_held_out_flag_is_one_line_naming_it(tmp_path):
    """A line of JSON cut short, read as the stream reaches it (here, the second row); --eval_file that is not there
    (not blamed on --dataset as an unknown hub dataset); --dataset_test_split naming the training split."""
    damaged = tmp_path / "damaged.jsonl"
    damaged.write_text('{"text": "a whole row"}\n{"text": "broken\n')
    with pytest.raises(UserError, match=rf"cannot stream the 'train' split of --dataset {damaged}: \w"):
        list(stream.read_rows(str(damaged), "", 0, 0, 0))
    chats, splits = _chats(tmp_path / "chats.jsonl", 20), tmp_path / "splits"
    splits.mkdir()
    for split in ("train", "test"):
        _chats(splits / f"{split}.jsonl", 20)

    def build(**given):
        settings = Settings(model="llama-tiny", tokenizer="bytes", streaming="on", max_steps=2, **given)
        return text_sets.build_text_sets(settings, TextModel("", 8192, 128), "causal_lm", tmp_path / "run")
    with pytest.raises(UserError, match=f"--eval_file {tmp_path / 'gone.jsonl'} is not a file or folder here"):
        build(dataset=str(chats), eval_file=str(tmp_path / "gone.jsonl"))
    with pytest.raises(UserError, match="--dataset_test_split train is the training split too"):
        build(dataset=str(splits), dataset_test_split="train")
    assert len(build(dataset=str(splits), packing="off")[1]) == 20  # test.jsonl, held out by default
