"""Datasets (one small builder per source) and per-rank loaders."""
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from app.errors import UserError


@dataclass
class DataInfo:
    """What a model needs to know about the data."""
    num_classes: int
    in_channels: int = 0
    image_size: int = 0
    task: str = "image_classification"
    """image_classification, causal_lm or sequence_classification."""
    vocab_size: int = 0
    """Tokens in the tokenizer (text only)."""
    seq_len: int = 0
    """Tokens per sample (text only): the block length, or the padded row length."""


def _digits(data_dir, image_size):
    """scikit-learn's bundled 8x8 handwritten digits: 1,797 real images, a fixed 80/20 split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = (images - 0.3) / 0.4  # roughly zero mean, unit variance
    labels = torch.tensor(digits.target, dtype=torch.long)
    train_idx, eval_idx = train_test_split(range(len(labels)), test_size=0.2, random_state=0, stratify=labels)
    train_idx, eval_idx = torch.tensor(train_idx), torch.tensor(eval_idx)
    return (TensorDataset(images[train_idx], labels[train_idx]), TensorDataset(images[eval_idx], labels[eval_idx]),
            DataInfo(10, 1, 8))


def _synthetic(data_dir, image_size, n_train=2048, n_eval=512, classes=10):
    """Random 3x32x32 images labelled by a fixed random linear teacher: learnable, no files needed."""
    gen = torch.Generator().manual_seed(1234)
    images = torch.randn(n_train + n_eval, 3, 32, 32, generator=gen)
    teacher = torch.randn(3 * 32 * 32, classes, generator=gen)
    labels = (images.flatten(1) @ teacher).argmax(1)
    return (TensorDataset(images[:n_train], labels[:n_train]), TensorDataset(images[n_train:], labels[n_train:]),
            DataInfo(classes, 3, 32))


TORCHVISION = {
    # name: (torchvision class, channels, size, mean, std, folder it creates under data_dir)
    "mnist": ("MNIST", 1, 28, (0.1307,), (0.3081,), "MNIST/raw"),
    "fashion_mnist": ("FashionMNIST", 1, 28, (0.2860,), (0.3530,), "FashionMNIST/raw"),
    "cifar10": ("CIFAR10", 3, 32, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), "cifar-10-batches-py"),
}


def _torchvision(name, data_dir, image_size):
    """A torchvision dataset from data_dir, downloaded there first when missing and online."""
    import torchvision
    from torchvision import transforms
    cls_name, channels, size, mean, std, folder = TORCHVISION[name]
    cls = getattr(torchvision.datasets, cls_name)
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    try:
        train = cls(data_dir, train=True, transform=tf, download=False)
    except RuntimeError:
        if os.environ.get("HF_HUB_OFFLINE") == "1":
            raise UserError(f"{cls_name} is not in {Path(data_dir) / folder} and HF_HUB_OFFLINE=1 forbids downloading "
                            f"it; put the dataset files there or unset HF_HUB_OFFLINE while online") from None
        try:
            train = cls(data_dir, train=True, transform=tf, download=True)
        except Exception as e:
            raise UserError(f"{cls_name} is not in {Path(data_dir) / folder} and could not be downloaded "
                            f"({type(e).__name__}); put the dataset files there or run once while online") from None
    evaluation = cls(data_dir, train=False, transform=tf, download=False)
    return train, evaluation, DataInfo(len(train.classes), channels, size)


def _imagefolder(data_dir, image_size):
    """data_dir/train/<class>/*.png and data_dir/val/<class>/*.png (or a fixed 10% held out of train)."""
    import torchvision
    from torchvision import transforms
    root = Path(data_dir)
    train_dir = root / "train" if (root / "train").is_dir() else root
    if not train_dir.is_dir() or not any(train_dir.iterdir()):
        raise UserError(f"ImageFolder data directory {train_dir} is missing or empty; put one folder of images "
                        f"per class in {root}/train (and optionally {root}/val)")
    tf = transforms.Compose([transforms.Resize(image_size), transforms.CenterCrop(image_size), transforms.ToTensor(),
                             transforms.Normalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))])
    try:
        train = torchvision.datasets.ImageFolder(str(train_dir), transform=tf)
    except (FileNotFoundError, RuntimeError) as e:
        raise UserError(f"ImageFolder {train_dir}: {e}") from None
    val_dir = next((root / d for d in ("val", "test") if (root / d).is_dir()), None)
    if val_dir is not None:
        evaluation = torchvision.datasets.ImageFolder(str(val_dir), transform=tf)
    else:
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0)).tolist()
        cut = max(1, len(order) // 10)
        evaluation = torch.utils.data.Subset(train, order[:cut])
        train = torch.utils.data.Subset(train, order[cut:])
    classes = len(train.classes) if hasattr(train, "classes") else len(train.dataset.classes)
    return train, evaluation, DataInfo(classes, 3, image_size)


BUILDERS = {
    "digits": _digits,
    "synthetic": _synthetic,
    "imagefolder": _imagefolder,
    **{name: (lambda data_dir, image_size, _n=name: _torchvision(_n, data_dir, image_size)) for name in TORCHVISION},
}


def build_datasets(name: str, data_dir: str, image_size: int = 224):
    """(train, eval, DataInfo) for a dataset name."""
    if name not in BUILDERS:
        hint = " (text needs a transformers model, e.g. --model gpt2-tiny)" if Path(name).exists() else ""
        raise UserError(f"unknown image dataset {name!r}; choose one of {', '.join(sorted(BUILDERS))}{hint}")
    return BUILDERS[name](data_dir, image_size)


class ShardSampler:
    """Per-rank batches of one global order: each sample once per epoch across ranks, equal step counts.

    Global batch k is order[k*B*W : (k+1)*B*W]; rank r takes every W-th sample of it. When the last
    global batch is short, ranks are padded to a full micro batch with weight-0 samples, so every rank
    runs the same number of steps (and collectives). Each real sample carries weight W / (samples in
    its global batch): summing weight x loss on every rank and averaging gradients over ranks gives
    exactly the mean over the global batch.
    """

    def __init__(self, size, batch_size, rank=0, world_size=1, shuffle=True, seed=0):
        if size == 0:
            raise UserError("the dataset is empty; check --dataset and --data_dir")
        self.size, self.batch_size, self.rank, self.world_size = size, batch_size, rank, world_size
        self.shuffle, self.seed, self.epoch, self.skip = shuffle, seed, 0, 0

    def set_epoch(self, epoch: int, skip: int = 0):
        """Pick the order for an epoch (the same on every rank), leaving out its first `skip` batches."""
        self.epoch, self.skip = epoch, skip

    def __len__(self):
        return math.ceil(self.size / (self.batch_size * self.world_size))

    def __iter__(self):
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.size, generator=gen).tolist()
        else:
            order = list(range(self.size))
        span = self.batch_size * self.world_size
        for start in range(self.skip * span, self.size, span):
            chunk = order[start:start + span]
            weight = self.world_size / len(chunk)
            mine = [(i, weight) for i in chunk[self.rank::self.world_size]]
            mine += [(chunk[0], 0.0)] * (self.batch_size - len(mine))
            yield mine


class Weighted(Dataset):
    """Wraps a dataset so each item is (input, label, weight) for the ShardSampler's (index, weight)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        index, weight = key
        x, y = self.dataset[index]
        return x, y, torch.tensor(weight, dtype=torch.float32)


def build_loader(dataset, batch_size, rank, world_size, shuffle, seed, num_workers=0, pin_memory=False):
    """A DataLoader over this rank's shard of dataset."""
    sampler = ShardSampler(len(dataset), batch_size, rank, world_size, shuffle, seed)
    return DataLoader(Weighted(dataset), batch_sampler=sampler, num_workers=num_workers, pin_memory=pin_memory,
                      persistent_workers=num_workers > 0)
