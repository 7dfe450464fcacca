"""Per-rank loaders: every rank takes its share of one global order, padded to equal steps."""
import math

import torch
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from app.errors import UserError


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


def feeding(dataset, cuda: bool, cores_per_rank: int, num_workers: int = -1, pin_memory: str = "auto") -> tuple:
    """(workers, pin) for --num_workers and --pin_memory, "auto" resolved as PyTorch's performance guide advises.

    On a GPU, batches go through pinned memory (their copy overlaps compute) and a dataset that reads or
    decodes each sample gets worker processes, up to 4, leaving the training process a core; a dataset
    already in memory (tensors) gains nothing from workers but their start-up. On a CPU the training step
    uses every core, so neither.
    """
    base = dataset.dataset if isinstance(dataset, Subset) else dataset
    in_memory = isinstance(base, TensorDataset)
    workers = num_workers if num_workers >= 0 else \
        min(4, max(0, cores_per_rank - 1)) if cuda and not in_memory else 0
    return workers, (cuda if pin_memory == "auto" else pin_memory == "on")


def build_loader(dataset, batch_size, rank, world_size, shuffle, seed, num_workers=0, pin_memory=False,
                 persistent=True):
    """A DataLoader over this rank's shard of dataset; persistent: its workers live from epoch to epoch (the
    training loader's), else they start for each pass and end with it (evaluation's, so that a rank's worker
    budget is not held twice through training)."""
    sampler = ShardSampler(len(dataset), batch_size, rank, world_size, shuffle, seed)
    return DataLoader(Weighted(dataset), batch_sampler=sampler, num_workers=num_workers, pin_memory=pin_memory,
                      persistent_workers=persistent and num_workers > 0)
