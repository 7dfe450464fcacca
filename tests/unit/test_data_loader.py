"""Every rank's shard is disjoint, complete and equally long; the loader yields inputs, labels and weights."""
import pytest
import torch

from app.data import loader
from app.data.images import build_image_sets
from app.errors import UserError


@pytest.mark.parametrize("size", [1, 5, 7, 64, 65, 1437])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("batch", [1, 4, 32])
def test_shards_are_disjoint_complete_and_in_step(size, world, batch):
    samplers = [loader.ShardSampler(size, batch, rank, world, shuffle=True, seed=3) for rank in range(world)]
    for sampler in samplers:
        sampler.set_epoch(2)
    per_rank = [list(s) for s in samplers]
    assert len({len(batches) for batches in per_rank}) == 1, "every rank runs the same number of steps"
    assert all(len(b) == batch for batches in per_rank for b in batches)
    real = [i for batches in per_rank for b in batches for i, w in b if w > 0]
    assert sorted(real) == list(range(size)), "each sample exactly once per epoch across ranks"
    for step in zip(*per_rank):  # the weights of one global batch add up to the world size
        assert sum(w for b in step for _, w in b) == pytest.approx(world)


def test_epochs_reshuffle_identically_on_every_rank():
    a, b = loader.ShardSampler(100, 4, 0, 1, seed=1), loader.ShardSampler(100, 4, 0, 1, seed=1)
    a.set_epoch(0), b.set_epoch(0)
    first = list(a)
    assert first == list(b)
    a.set_epoch(1)
    assert list(a) != first
    unshuffled = loader.ShardSampler(10, 4, 0, 1, shuffle=False)
    assert [i for batch in unshuffled for i, w in batch if w > 0] == list(range(10))


@pytest.mark.parametrize("world", [1, 2])
def test_a_resumed_epoch_skips_the_batches_already_done(world):
    """set_epoch(epoch, skip) leaves out the epoch's first `skip` batches on every rank, the rest unchanged."""
    for rank in range(world):
        whole, resumed = (loader.ShardSampler(45, 4, rank, world, seed=7) for _ in range(2))
        whole.set_epoch(3)
        resumed.set_epoch(3, skip=2)
        assert list(resumed) == list(whole)[2:] and len(list(whole)) == len(whole)


def test_loader_yields_inputs_labels_and_weights():
    train, _, _ = build_image_sets("synthetic", "unused")
    batches = loader.build_loader(train, 8, rank=1, world_size=2, shuffle=True, seed=0)
    x, y, w = next(iter(batches))
    assert x.shape == (8, 3, 32, 32) and y.shape == (8,) and torch.allclose(w, torch.full((8,), 1 / 8))
    assert len(batches) == 2048 // 16


def test_empty_dataset_is_a_user_error():
    with pytest.raises(UserError, match="empty"):
        loader.ShardSampler(0, 4)


def test_auto_feeding_pins_and_adds_workers_only_where_a_gpu_waits_on_the_data():
    from torch.utils.data import Subset, TensorDataset
    from app.data.loader import feeding
    tensors = TensorDataset(torch.zeros(8, 2), torch.zeros(8))
    decoded = [(i, i) for i in range(8)]  # any dataset that builds each sample when asked
    assert feeding(tensors, cuda=True, cores_per_rank=8) == (0, True), "in memory: no workers to feed it"
    assert feeding(Subset(tensors, [0, 1]), cuda=True, cores_per_rank=8) == (0, True)
    assert feeding(decoded, cuda=True, cores_per_rank=8) == (4, True)
    assert feeding(decoded, cuda=True, cores_per_rank=2) == (1, True), "one core stays with the training step"
    assert feeding(decoded, cuda=False, cores_per_rank=8) == (0, False), "on a CPU the step uses every core"
    assert feeding(decoded, cuda=True, cores_per_rank=8, num_workers=2, pin_memory="off") == (2, False)
    assert feeding(tensors, cuda=False, cores_per_rank=8, num_workers=0, pin_memory="on") == (0, True)


def test_workers_are_counted_from_the_cores_the_process_may_use():
    """Slurm and containers limit a job's CPUs through its affinity; os.cpu_count() sees the whole machine."""
    import os
    from app.distributed.cores import usable_cores
    allowed = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(allowed)})
        assert usable_cores() == 1
    finally:
        os.sched_setaffinity(0, allowed)
    assert usable_cores() == len(allowed)


def test_evaluation_workers_live_only_while_it_evaluates():
    """The training loader keeps its workers through the run; evaluation's start and end with each pass, so a
    rank holds one budget of workers, not two."""
    from types import SimpleNamespace
    from torch.utils.data import TensorDataset
    from app.data import Data
    rows = TensorDataset(torch.zeros(16, 2), torch.zeros(16))
    data = Data(rows, rows, None)
    settings = SimpleNamespace(seed=0, num_workers=2, pin_memory="off")
    world = SimpleNamespace(device=torch.device("cpu"), local_world_size=1)
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}
    train_loader, eval_loader = loader.run_loaders(data, ds, settings, world, SimpleNamespace(replica=0, replicas=1))
    assert (train_loader.num_workers, train_loader.persistent_workers) == (2, True)
    assert (eval_loader.num_workers, eval_loader.persistent_workers) == (2, False)


SPLITS = [(4, 1, 2), (1, 4, 2), (8, 1, 1), (2, 2, 2)]  # micro batch, accumulation, ranks: 8 rows per step each


@pytest.mark.parametrize("size", [64, 96])
def test_a_steps_weights_do_not_depend_on_how_it_is_split(size):
    """DeepSpeed divides each micro batch's loss by the accumulation A and averages gradients over the W ranks, so a
    row's share of the step is weight / (W x A): it must be units / (units of the step's rows) whatever the split,
    for rows of unequal units (answer tokens), in every step, across epochs too."""
    units = torch.randint(1, 50, (size,), generator=torch.Generator().manual_seed(0)).tolist()
    shares = []
    for micro, accumulation, world in SPLITS:
        found = {}
        for epoch in range(3):
            samplers = [loader.ShardSampler(size, micro, rank, world, seed=5, accumulation=accumulation, units=units)
                        for rank in range(world)]
            for sampler in samplers:
                sampler.set_epoch(epoch)
            for k, step in enumerate(zip(*samplers)):
                for batch in step:
                    for i, w in batch:
                        if w > 0:
                            key = (epoch * len(samplers[0]) + k) // accumulation, i
                            found[key] = found.get(key, 0) + w / (world * accumulation)
        shares.append(found)
    for found in shares[1:]:
        assert found.keys() == shares[0].keys()
        assert all(found[key] == pytest.approx(shares[0][key], rel=1e-12) for key in found)
    by_step = {}
    for (step, i), share in shares[0].items():
        by_step.setdefault(step, []).append((i, share))
    for rows in by_step.values():
        total = sum(units[i] for i, _ in rows)
        assert all(share == pytest.approx(units[i] / total) for i, share in rows)


def test_a_window_that_spans_two_epochs_weighs_the_rows_of_both():
    """5 micro batches an epoch with accumulation 2: the third optimizer step takes the last of epoch 0 and the
    first of epoch 1; its rows' shares add up to one over both."""
    size, units = 20, list(range(1, 21))
    sampler = loader.ShardSampler(size, 4, 0, 1, seed=1, accumulation=2, units=units)
    first, second = (list(sampler) for _ in [sampler.set_epoch(0)]), None
    epoch0 = next(first)
    sampler.set_epoch(1)
    epoch1 = list(sampler)
    spanning = [w for i, w in epoch0[4] + epoch1[0]]
    assert sum(spanning) / 2 == pytest.approx(1.0) and second is None


def test_a_resume_at_another_world_size_weighs_deepspeeds_windows_from_where_it_resumes():
    """Saved on 2 ranks at step 1 (micro 2, accumulation 4: 16 rows), resumed on 3: 16 rows are 2 global micro
    batches of 6 and a third of it, so the resumed run starts at micro batch 2, and DeepSpeed counts its micro
    steps from 0 again there. Each run of 4 micro batches from there is one optimizer step: its weights, over the
    ranks, add up to W x A as in any step."""
    units = torch.randint(1, 50, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    samplers = [loader.ShardSampler(100, 2, rank, 3, seed=5, accumulation=4, units=units) for rank in range(3)]
    for sampler in samplers:
        sampler.set_epoch(0, skip=2)
    steps = list(zip(*samplers))
    for first in range(0, len(steps) - 3, 4):
        total = sum(w for step in steps[first:first + 4] for batch in step for _, w in batch)
        assert total == pytest.approx(12), first


def test_evaluation_weighs_each_row_by_its_units():
    sampler = loader.ShardSampler(6, 4, 0, 1, shuffle=False, units=[3, 1, 2, 5, 4, 1], normalise=False)
    assert list(sampler) == [[(0, 3.0), (1, 1.0), (2, 2.0), (3, 5.0)], [(4, 4.0), (5, 1.0), (4, 0.0), (4, 0.0)]]


def _global(sampler_of, world: int, epochs: int) -> list:
    """Every global micro batch of the first epochs: [(index, weight) of every rank, rank by rank]."""
    samplers = [sampler_of(rank) for rank in range(world)]
    found = []
    for epoch in range(epochs):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        found += [[pair for batch in step for pair in batch] for step in zip(*samplers)]
    return found


@pytest.mark.parametrize("size,micro,accumulation,world", [(32, 2, 2, 2), (20, 4, 2, 1), (21, 2, 3, 2)])
def test_repeats_give_each_window_that_many_times_with_its_weights(size, micro, accumulation, world):
    """GRPO's --num_iterations 3: the windows of the plain order, each three times over before the next, the same
    batches and weights each time; the epoch three times as long. (20 and 21 rows make windows that span epochs.)"""
    units = list(range(1, size + 1))
    once = _global(lambda r: loader.ShardSampler(size, micro, r, world, seed=4, accumulation=accumulation,
                                                 units=units), world, 4)  # a window may reach into the 4th
    thrice = _global(lambda r: loader.ShardSampler(size, micro, r, world, seed=4, accumulation=accumulation,
                                                   units=units, repeats=3), world, 3)
    assert len(thrice) == 3 * len(once) * 3 // 4
    windows = [once[k:k + accumulation] for k in range(0, len(once), accumulation)]
    expected = [batch for window in windows for _ in range(3) for batch in window]
    assert thrice == expected[:len(thrice)]


def test_a_resume_inside_a_repeated_window_takes_the_same_batches():
    whole, resumed = (loader.ShardSampler(21, 2, 1, 2, seed=2, accumulation=3, repeats=2) for _ in range(2))
    whole.set_epoch(1)
    resumed.set_epoch(1, skip=4)
    assert len(whole) == 2 * 6 and list(resumed) == list(whole)[4:]
