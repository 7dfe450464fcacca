"""Datasets build offline, and every rank's shard is disjoint, complete and equally long."""
import struct

import pytest
import torch

from app import data
from app.errors import UserError


@pytest.mark.parametrize("size", [1, 5, 7, 64, 65, 1437])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("batch", [1, 4, 32])
def test_shards_are_disjoint_complete_and_in_step(size, world, batch):
    samplers = [data.ShardSampler(size, batch, rank, world, shuffle=True, seed=3) for rank in range(world)]
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
    a, b = data.ShardSampler(100, 4, 0, 1, seed=1), data.ShardSampler(100, 4, 0, 1, seed=1)
    a.set_epoch(0), b.set_epoch(0)
    first = list(a)
    assert first == list(b)
    a.set_epoch(1)
    assert list(a) != first
    unshuffled = data.ShardSampler(10, 4, 0, 1, shuffle=False)
    assert [i for batch in unshuffled for i, w in batch if w > 0] == list(range(10))


def test_digits_is_a_fixed_real_split():
    train, held_out, info = data.build_datasets("digits", "unused")
    assert (len(train), len(held_out)) == (1437, 360)
    assert (info.num_classes, info.in_channels, info.image_size) == (10, 1, 8)
    x, y = train[0]
    assert x.shape == (1, 8, 8) and 0 <= int(y) < 10
    assert torch.bincount(held_out.tensors[1]).min() >= 34, "stratified: every digit held out"
    again = data.build_datasets("digits", "unused")[1]
    assert torch.equal(again.tensors[0], held_out.tensors[0])


def test_loader_yields_inputs_labels_and_weights():
    train, _, _ = data.build_datasets("synthetic", "unused")
    loader = data.build_loader(train, 8, rank=1, world_size=2, shuffle=True, seed=0)
    x, y, w = next(iter(loader))
    assert x.shape == (8, 3, 32, 32) and y.shape == (8,) and torch.allclose(w, torch.full((8,), 1 / 8))
    assert len(loader) == 2048 // 16


def _write_idx(path, array, magic):
    with open(path, "wb") as f:
        f.write(struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape))
        f.write(array.numpy().tobytes())


@pytest.mark.parametrize("name, folder", [("mnist", "MNIST"), ("fashion_mnist", "FashionMNIST")])
def test_torchvision_idx_files_from_data_dir(name, folder, tmp_path):
    raw = tmp_path / folder / "raw"
    raw.mkdir(parents=True)
    for prefix, n in (("train", 12), ("t10k", 5)):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8), 0x803)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", torch.arange(n, dtype=torch.uint8) % 10, 0x801)
    train, held_out, info = data.build_datasets(name, str(tmp_path))
    assert (len(train), len(held_out), info.num_classes, info.in_channels) == (12, 5, 10, 1)
    x, y = train[3]
    assert x.shape == (1, 28, 28) and y == 3


def _images(root, classes=("cat", "dog"), per_class=5):
    from PIL import Image
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (20, 12), (40 * c, 10 * i, 0)).save(root / name / f"{i}.png")


def test_imagefolder_with_val_dir(tmp_path):
    _images(tmp_path / "train")
    _images(tmp_path / "val", per_class=2)
    train, held_out, info = data.build_datasets("imagefolder", str(tmp_path), image_size=16)
    assert (len(train), len(held_out), info.num_classes) == (10, 4, 2)
    assert train[0][0].shape == (3, 16, 16)


def test_imagefolder_without_val_holds_out_a_tenth(tmp_path):
    _images(tmp_path, per_class=10)
    train, held_out, info = data.build_datasets("imagefolder", str(tmp_path), image_size=8)
    assert (len(train), len(held_out), info.num_classes) == (18, 2, 2)


def test_empty_imagefolder_is_a_user_error(tmp_path):
    (tmp_path / "train").mkdir()
    with pytest.raises(UserError, match="missing or empty"):
        data.build_datasets("imagefolder", str(tmp_path))


def test_empty_dataset_is_a_user_error():
    with pytest.raises(UserError, match="empty"):
        data.ShardSampler(0, 4)
