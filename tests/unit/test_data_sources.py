"""Several training sources (app/data/sources.py): the --dataset list and its names, --mix_weights and --eval_file
read, each epoch's draw by weight of rows or tokens, and the sampler that shards the draw over ranks and counts what
each source gave."""
import collections
from pathlib import Path

import numpy as np
import pytest

from app.data import loader, sources
from app.data.samples import Samples
from app.errors import UserError


def test_the_dataset_list_its_names_and_a_path_with_a_comma(tmp_path):
    odd = tmp_path / "a,b.jsonl"
    odd.write_text("{}\n")
    (tmp_path / "chats").mkdir()
    assert sources.split_sources(str(odd)) == [str(odd)]
    assert sources.split_sources("org/alpaca, ./x.jsonl") == ["org/alpaca", "./x.jsonl"]
    with pytest.raises(UserError, match="an empty name between its commas"):
        sources.split_sources("a.jsonl,,b.jsonl")
    listed = [str(odd), str(tmp_path / "chats") + "/", "org/alpaca", "other/alpaca"]
    assert sources.source_names(listed) == ["a,b", "chats", "alpaca-1", "alpaca-2"]


def test_weights_and_held_out_files_are_read_or_refused_in_one_line(tmp_path, monkeypatch):
    assert sources.mix_weights("", 3) is None
    assert sources.mix_weights("2,1,1", 3) == [0.5, 0.25, 0.25]
    assert sources.mix_weights("0,1", 2) == [0.0, 1.0]
    for text, count, says in [("1,1", 1, "this run has one"), ("2,x", 2, "one number per --dataset source"),
                              ("1,2,3", 2, "3 weight\\(s\\) for 2 --dataset sources"),
                              ("0,0", 2, "not all 0"), ("-1,2", 2, "numbers of 0 or more"),
                              ("nan,1", 2, "numbers of 0 or more")]:
        with pytest.raises(UserError, match=says):
            sources.mix_weights(text, count)
    monkeypatch.chdir(tmp_path)
    for name in ("h.jsonl", "ha.jsonl", "hb.jsonl", "x,y.jsonl"):
        Path(name).write_text('{"text": "held out"}\n')
    assert sources.eval_files("", ["a", "b"]) == []
    assert sources.eval_files("h.jsonl", ["a", "b"]) == ["h.jsonl"]
    assert sources.eval_files("ha.jsonl, hb.jsonl", ["a", "b"]) == ["ha.jsonl", "hb.jsonl"]
    assert sources.eval_files("x,y.jsonl", ["a"]) == ["x,y.jsonl"]
    with pytest.raises(UserError, match="names 2 files for 3 --dataset sources; give one per source"):
        sources.eval_files("ha,hb", ["a", "b", "c"])
    with pytest.raises(UserError, match="--eval_file hc.jsonl is not a file or folder here"):  # not a hub dataset
        sources.eval_files("ha.jsonl, hc.jsonl", ["a", "b"])


def test_sources_alike_get_names_no_other_source_has(tmp_path):
    """Two a.jsonl and an a-2.jsonl: a-2 is not named twice (one source's eval_loss/rows columns and held-out loader
    would stand for both)."""
    paths = [tmp_path / "x" / "a.jsonl", tmp_path / "y" / "a.jsonl", tmp_path / "a-2.jsonl"]
    for path in paths:
        path.parent.mkdir(exist_ok=True)
        path.write_text('{"text": "a row"}\n')
    names = sources.source_names([str(p) for p in paths])
    assert names == ["a-1", "a-3", "a-2"], "a-2.jsonl keeps its own name, in any order"
    assert sources.source_names([str(p) for p in paths[::-1]]) == ["a-2", "a-1", "a-3"]


@pytest.mark.parametrize("by", ["rows", "tokens"])
def test_each_epoch_draws_each_sources_share_afresh(by):
    sizes, tokens, weights = [50, 300, 7], [5000, 3000, 700], [0.5, 0.25, 0.25]
    mixture = sources.Mixture(sizes, tokens, weights, by, seed=4)
    total = sum(sizes)
    assert sum(mixture.counts) == total
    share = np.asarray(weights) / (np.asarray(tokens) / sizes if by == "tokens" else 1)
    expected = share / share.sum() * total
    assert np.all(np.abs(np.asarray(mixture.counts) - expected) < 1)  # rounded, the largest remainders up
    orders = [mixture.order(epoch) for epoch in range(3)]
    for order in orders:
        which = np.searchsorted(mixture.offsets, order, side="right") - 1
        assert np.bincount(which, minlength=3).tolist() == mixture.counts
        for source, (offset, size, count) in enumerate(zip(mixture.offsets, sizes, mixture.counts)):
            drawn = collections.Counter(i - offset for i, w in zip(order, which) if w == source)
            assert all(0 <= i < size for i in drawn)
            low, high = divmod(count, size)[0], -(-count // size)
            assert set(drawn.values()) <= {low, high} and (count < size or len(drawn) == size)
    assert orders[0] != orders[1] and orders[0] == sources.Mixture(sizes, tokens, weights, by, seed=4).order(0)
    assert sources.Mixture(sizes, tokens, weights, by, seed=5).order(0) != orders[0]
    assert "repeated" in mixture.describe(["a", "b", "c"], by) or "sampled" in mixture.describe(["a", "b", "c"], by)


def test_a_source_of_weight_zero_gives_no_row():
    mixture = sources.Mixture([10, 20], [10, 20], [0.0, 1.0], "rows", seed=0)
    assert mixture.counts == [0, 30] and min(mixture.order(0)) >= 10


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_take_exclusive_shares_of_the_draw_and_as_many_steps(world):
    """Sizes that divide neither the batch nor the ranks: every rank the same number of batches, the real samples
    of all ranks together the epoch's draw, and the counts each source gave as the draw says."""
    sizes, batch = [23, 41], 4
    table = sources.Sources(["a", "b"], [0, 23, 64], np.arange(64, dtype=float) + 1,
                            sources.Mixture(sizes, [230, 41], [2, 1], "rows", seed=1))
    samplers = [loader.ShardSampler(64, batch, rank, world, seed=1, sources=table) for rank in range(world)]
    for epoch in range(2):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        per_rank = [list(s) for s in samplers]
        assert len({len(batches) for batches in per_rank}) == 1
        real = [i for step in zip(*per_rank) for b in step for i, w in b if w > 0]
        assert sorted(real) == sorted(table.mixture.order(epoch))
    first, second = table.counts(table.mixture.order(0)), table.counts(table.mixture.order(1))
    done = 3  # global micro batches into epoch 1
    partial = table.counts(table.mixture.order(1)[:done * batch * world])
    drawn = samplers[0].drawn(1, done)
    assert drawn == {"rows/a": first[0][0] + partial[0][0], "rows/b": first[0][1] + partial[0][1],
                     "tokens/a": first[1][0] + partial[1][0], "tokens/b": first[1][1] + partial[1][1]}
    assert samplers[0].drawn(1, len(samplers[0]))["rows/a"] == first[0][0] + second[0][0]
    assert loader.ShardSampler(64, batch).drawn(0, 1) == {}


def test_a_part_is_one_sources_held_out_rows_with_their_units():
    class Rows(Samples):
        units = [1.0, 2.0, 3.0, 4.0, 5.0]

        def __len__(self):
            return 5

        def __getitem__(self, i):
            return i * 10
    part = loader.Part(Rows(), 2, 5)
    assert len(part) == 3 and [part[i] for i in range(3)] == [20, 30, 40] and part.units == [3.0, 4.0, 5.0]


def test_repeated_windows_count_their_rows_once():
    """With repeats 2 and accumulation 2 each window of two global micro batches comes twice: the counts grow over
    its first coming and hold through the second."""
    table = sources.Sources(["a", "b"], [0, 23, 64], np.arange(64, dtype=float) + 1,
                            sources.Mixture([23, 41], [230, 41], [2, 1], "rows", seed=1))
    once = loader.ShardSampler(64, 4, 0, 2, seed=1, sources=table, accumulation=2)
    twice = loader.ShardSampler(64, 4, 0, 2, seed=1, sources=table, accumulation=2, repeats=2)
    assert len(twice) == 2 * len(once) == 16
    real = [0, 1, 2, 2, 2, 3, 4, 4, 4, 5, 6, 6, 6, 7, 8, 8, 8]  # global micro batches drawn after k of twice's
    assert [twice.drawn(0, k) for k in range(17)] == [once.drawn(0, n) for n in real]
    assert twice.drawn(1, 0) == once.drawn(1, 0)
