"""Per-rank loaders: every rank takes its share of one global order, padded to equal steps."""
import math

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from app.data import Data
from app.data.samples import Samples, declared, weights
from app.data.stream import StreamLoader
from app.distributed import dist
from app.distributed.cores import usable_cores
from app.errors import UserError


class ShardSampler:
    """Per-rank batches of one global order: each sample once per epoch across ranks, equal step counts.

    Global micro batch k is order[k*B*W : (k+1)*B*W]; rank r takes every W-th sample of it. When the last one is
    short, ranks are padded to a full micro batch with weight-0 samples, so every rank runs the same number of steps
    (and collectives).

    Weights make the loss of an optimizer step the mean over the units (samples, or a row's answer tokens: units[i])
    of its whole window, A = accumulation micro batches on every rank, however it is split: a real sample i weighs
    W x A x units[i] / (units in its window). DeepSpeed divides each micro batch's loss by A and averages gradients
    over the W ranks, so summing weight x per-unit-mean loss gives exactly that mean. The windows are DeepSpeed's,
    counted in micro batches from where this process started (the run's start, or the resumed position: DeepSpeed
    counts its micro steps from 0 again, which at another world size or micro batch need not fall on a window the
    first run had), so one may span two epochs; the counts come from the data on the host, never from the device.
    normalise=False (evaluation) weighs each sample by its units alone.

    repeats R (GRPO's --num_iterations): each window comes R times over before the next, so an epoch is R times
    the micro batches and each of its samples trains R optimizer steps; a window's weights are the same each time.
    """

    def __init__(self, size, batch_size, rank=0, world_size=1, shuffle=True, seed=0, accumulation=1, units=None,
                 normalise=True, sources=None, repeats=1):
        if size == 0:
            raise UserError("the dataset is empty; check --dataset and --data_dir")
        self.size, self.batch_size, self.rank, self.world_size = size, batch_size, rank, world_size
        self.batches, self.repeats = math.ceil(size / (batch_size * world_size)), repeats  # an epoch's, each once
        self.shuffle, self.seed, self.epoch, self.skip, self.origin = shuffle, seed, 0, 0, None
        self.accumulation, self.normalise = accumulation, normalise
        # plain numbers on the host (numpy), never tensors: nothing the step might wait on
        self.units = np.ones(size) if units is None else np.asarray(units, dtype=np.float64)
        self._per_batch = {}  # epoch -> units of each global micro batch
        self.sources, self._drawn = sources, {}  # app/data/sources.py: several sources; epoch -> (rows, tokens)

    def set_epoch(self, epoch: int, skip: int = 0):
        """Pick the order for an epoch (the same on every rank), leaving out its first `skip` batches; the units of
        the epochs its windows reach into are counted now, between steps."""
        self.epoch, self.skip = epoch, skip
        if self.origin is None:  # the global micro batch DeepSpeed's first window starts at (repeated windows
            self.origin = epoch * self.batches + skip if self.repeats == 1 else 0  # resume only as they were)
        if self.normalise and self.accumulation > 1:
            reach = -(-self.accumulation // self.batches)
            for near in range(max(0, epoch - reach), epoch + reach + 1):
                self._batch_units(near)

    def __len__(self):
        return self.batches * self.repeats

    def _order(self, epoch: int) -> list:
        if not self.shuffle:
            return list(range(self.size))
        if self.sources is not None and self.sources.mixture is not None:
            return self.sources.mixture.order(epoch)
        return torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()

    def _repeated(self, epoch: int, k: int, count: bool = False) -> tuple:
        """(epoch, k) of the global micro batch that the epoch's k-th repeats (repeats 1: itself); count: of the
        global micro batches drawn once the epoch's first k have been."""
        a, r = self.accumulation, self.repeats
        g = epoch * len(self) + k
        drawn = g // (a * r) * a + (min(g % (a * r), a) if count else g % a)
        return divmod(drawn, self.batches)

    def drawn(self, epoch: int, done: int) -> dict:
        """With several sources, the rows and tokens each gave from the run's start to global micro batch `done` of
        epoch (metrics.csv's rows/<name> and tokens/<name>); padding left out. Else nothing."""
        if self.sources is None:
            return {}
        epoch, done = self._repeated(epoch, done, count=True)
        rows, tokens = self._counted(epoch)[done]
        for past in range(epoch):
            rows, tokens = rows + self._counted(past)[-1][0], tokens + self._counted(past)[-1][1]
        names = self.sources.names
        return {**{f"rows/{n}": int(r) for n, r in zip(names, rows)},
                **{f"tokens/{n}": int(t) for n, t in zip(names, tokens)}}

    def _counted(self, epoch: int) -> list:
        """(rows, tokens) of each source in an epoch's first k global micro batches, for k = 0..len (kept)."""
        if epoch not in self._drawn:
            order, span = self._order(epoch), self.batch_size * self.world_size
            steps = [self.sources.counts(order[k:k + span]) for k in range(0, self.size, span)]
            zero = np.zeros(len(self.sources.names))
            rows, tokens = (np.cumsum([zero] + [step[i] for step in steps], axis=0) for i in (0, 1))
            self._drawn[epoch] = list(zip(rows, tokens))
            top = max(self._drawn)  # the epoch being trained keeps every count, the ones before their totals
            self._drawn = {e: kept if e == top else kept[-1:] for e, kept in self._drawn.items()}
        return self._drawn[epoch]

    def _batch_units(self, epoch: int) -> list:
        """The units of each global micro batch of an epoch (a few epochs are kept)."""
        if epoch not in self._per_batch:
            span, order = self.batch_size * self.world_size, np.asarray(self._order(epoch))
            self._per_batch = {e: v for e, v in self._per_batch.items() if abs(e - epoch) <= self.accumulation + 1}
            self._per_batch[epoch] = [float(self.units[order[k:k + span]].sum()) for k in range(0, self.size, span)]
        return self._per_batch[epoch]

    def _window_units(self, epoch: int, k: int) -> float:
        """Units of the optimizer step's window that global micro batch k of epoch belongs to."""
        n, a, origin = self.batches, self.accumulation, self.origin or 0
        first = origin + (epoch * n + k - origin) // a * a
        return sum(self._batch_units(g // n)[g % n] for g in range(first, first + a))

    def __iter__(self):
        orders, span = {}, self.batch_size * self.world_size
        for k in range(self.skip, len(self)):
            epoch, j = self._repeated(self.epoch, k)
            if epoch not in orders:  # a repeated window may reach back and forth over an epoch's end
                orders = {e: o for e, o in orders.items() if abs(e - epoch) <= 1} | {epoch: self._order(epoch)}
            chunk = orders[epoch][j * span:(j + 1) * span]
            units = self.units[chunk[self.rank::self.world_size]].tolist()
            if self.normalise:
                units = weights(units, self._window_units(epoch, j), self.world_size, self.accumulation)
            mine = list(zip(chunk[self.rank::self.world_size], units))
            mine += [(chunk[0], 0.0)] * (self.batch_size - len(mine))
            yield mine


class Part(Samples):
    """Samples first..end of a dataset (one source's held-out rows, app/data/sources.py), with their units."""

    def __init__(self, dataset, first: int, end: int):
        self.dataset, self.first, self.end = dataset, first, end
        units = declared(dataset).units
        self.units = None if units is None else list(units[first:end])

    def __len__(self):
        return self.end - self.first

    def __getitem__(self, i):
        return self.dataset[self.first + i]


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


class ShardLoader(DataLoader):
    """The DataLoader of a rank's ShardSampler batches. The loop's calls, which StreamLoader (app/data/stream.py)
    answers alike: set_epoch, drawn, total_units, micro_batch, and len, the micro batches of an epoch."""

    def set_epoch(self, epoch: int, skip: int = 0):
        """Take the epoch's batches from its global micro batch `skip` on (ShardSampler.set_epoch)."""
        self.batch_sampler.set_epoch(epoch, skip)

    def drawn(self, epoch: int, done: int) -> dict:
        """Each source's rows and tokens trained on up to global micro batch `done` of epoch (ShardSampler.drawn)."""
        return self.batch_sampler.drawn(epoch, done)

    def total_units(self) -> float:
        """The units (samples, or answer tokens) of the whole set: the weight of its evaluation among others."""
        return float(self.batch_sampler.units.sum())

    @property
    def micro_batch(self) -> int:
        """Samples in each of this rank's micro batches."""
        return self.batch_sampler.batch_size


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
    workers = min(workers, 1) if declared(dataset).stream is not None else workers  # one sequence: one reader
    return workers, (cuda if pin_memory == "auto" else pin_memory == "on")


def build_loader(dataset, batch_size, rank, world_size, shuffle, seed, num_workers=0, pin_memory=False,
                 persistent=True, accumulation=1, normalise=True, repeats=1):
    """A ShardLoader over this rank's shard of dataset; persistent: its workers live from epoch to epoch (the
    training loader's), else they start for each pass and end with it (evaluation's, so that a rank's worker
    budget is not held twice through training). accumulation and normalise: the weights' (ShardSampler); the
    dataset's units (app/data/samples.py) count what each sample's loss averages over; its sources
    (app/data/sources.py), what each sample's source is and how the training order mixes them; repeats: how many
    times each window comes (ShardSampler)."""
    data = declared(dataset)
    sampler = ShardSampler(len(dataset), batch_size, rank, world_size, shuffle, seed, accumulation, data.units,
                           normalise, data.sources, repeats)
    return ShardLoader(Weighted(dataset), batch_sampler=sampler, num_workers=num_workers, pin_memory=pin_memory,
                       persistent_workers=persistent and num_workers > 0)


def training_loader(dataset, batch_size, rank, world_size, seed, num_workers=0, pin_memory=False, accumulation=1):
    """The training loader: a streamed set's StreamLoader (app/data/stream.py), else build_loader's, shuffled, each
    window as many times as the set declares (app/data/samples.py: repeats)."""
    stream = declared(dataset).stream
    if stream is not None:
        return StreamLoader(stream, batch_size, rank, world_size, accumulation, num_workers, pin_memory)
    return build_loader(dataset, batch_size, rank, world_size, True, seed, num_workers, pin_memory,
                        accumulation=accumulation, repeats=declared(dataset).repeats)


def held_out_loaders(eval_set, batch_size, **args):
    """The evaluation's loader, or with several sources one for each ({name: loader}, app/core/loop.py: evaluate)."""
    sources = declared(eval_set).sources
    parts = [(None, eval_set)] if sources is None else [(n, Part(eval_set, a, b)) for n, a, b in sources.parts()]
    loaders = {name: build_loader(part, batch_size, shuffle=False, persistent=False, normalise=False, **args)
               for name, part in parts}
    return loaders[None] if sources is None else loaders


def run_loaders(data: Data, ds: dict, settings, world, ranks) -> tuple:
    """A run's (train loader, eval loader) over this data-parallel replica's shard (ranks: the run's layout; the
    stages of a pipeline share one replica's), with its workers and pinning (feeding)."""
    workers, pin = feeding(data.train, world.device.type == "cuda", usable_cores() // world.local_world_size,
                           settings.num_workers, settings.pin_memory)
    if workers or pin:
        dist.print0(f"data: {workers} loader worker(s) per rank, {'pinned' if pin else 'pageable'} host memory")
    args = dict(rank=ranks.replica, world_size=ranks.replicas, seed=settings.seed, num_workers=workers,
                pin_memory=pin)
    micro = ds["train_micro_batch_size_per_gpu"]
    return (training_loader(data.train, micro, accumulation=ds["gradient_accumulation_steps"], **args),
            held_out_loaders(data.held_out, micro, **args))
