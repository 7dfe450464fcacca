"""What every mode of the benchmark builds on: the workload and the model it trains, the clock that times its steps,
the loader whose waits go on that clock, the parameter bytes a rank holds. The modes (bench_torch, bench_fsdp,
bench_modes) import it; it imports none of them."""
import copy
import time
from dataclasses import dataclass, replace

import torch
from torch.distributed.tensor import DTensor

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Workload:
    """The task, its training set and what the model needs to know about it."""
    task: object
    train_set: object
    info: object


def build_model(work: Workload, ds=None, lora: bool = False):
    """The model every mode trains, from the same seed (lora: with LoRA adapters, the rest frozen)."""
    torch.manual_seed(0)
    work.task.settings = replace(work.task.settings, lora=lora)
    return work.task.build_model(work.info, ds or {})


def counted_model(work: Workload, lora: bool = False):
    """build_model's model for counting its parameters and FLOPs alone: a transformers model on the meta device,
    from its config (an 8B model's weights are never made in this process, and a folder's are not read: transformers
    loads none on the meta device)."""
    if work.task.spec is None:
        return build_model(work, lora=lora)
    task = copy.copy(work.task)
    task.spec = replace(task.spec, pretrained="")
    with torch.device("meta"):
        return build_model(replace(work, task=task), lora=lora)


class Clock:
    """Marks the start and the end of each optimizer step, and the time each step waited for its batch. On a GPU
    each mark is a CUDA event, so the loop never waits for the device; times() synchronises once."""

    def __init__(self, device):
        self.device, self.marks, self.waits = device, [], []
        self.tick()

    after_tick = None  # called after each mark (the profiler's step)

    def tick(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())
        if self.after_tick:
            self.after_tick()

    def times(self) -> list:
        """Seconds from each mark to the next: the first is the time to the first step's end."""
        if self.device.type == "cuda":
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]

    def measured(self, warmup: int, steps: int) -> tuple:
        """(the first step's time, the times and the batch waits of the `steps` steps after the first `warmup`,
        the first step among those): steps run after them (a profile's) are in none."""
        times = self.times()
        return times[0], times[warmup:warmup + steps], self.waits[warmup:warmup + steps]


class TimedLoader:
    """A loader whose next() time goes on the clock; endless when `endless` (for the raw loops)."""

    def __init__(self, loader, clock, endless=False):
        self.loader, self.clock, self.endless = loader, clock, endless

    def __len__(self):
        return len(self.loader)

    def set_epoch(self, epoch: int, skip: int = 0):
        """The loader protocol the loop drives (app/data/loader.py: ShardLoader), passed through."""
        self.loader.set_epoch(epoch, skip)

    def drawn(self, epoch: int, done: int) -> dict:
        return self.loader.drawn(epoch, done)

    def total_units(self) -> float:
        return self.loader.total_units()

    def __iter__(self):
        epoch, start = 0, time.perf_counter()
        while True:
            it = iter(self.loader)
            while True:
                batch = next(it, None)
                if batch is None:  # the epoch's end: its time goes on the next batch's wait, one wait a step
                    break
                self.clock.waits.append(time.perf_counter() - start)
                yield batch
                start = time.perf_counter()
            if not self.endless:
                return
            epoch += 1
            self.loader.set_epoch(epoch)


def param_bytes(module) -> int:
    """Bytes of the parameters this rank holds: its stage, its shards, its ZeRO-3 partition or its FSDP2 shard."""
    held = (p.to_local() if isinstance(p, DTensor) else getattr(p, "ds_tensor", p) for p in module.parameters())
    return sum(t.numel() * t.element_size() for t in held)
