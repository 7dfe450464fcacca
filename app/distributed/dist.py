"""Run time inside the process group: who this rank is, printing from the main rank, collectives, teardown.

Every collective of the app goes through here (DeepSpeed's own, in app/ds/internals/, excepted).

Launch time (which launcher, its variables, the start-up rendezvous) lives in app/distributed/launch.py.
"""
import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist

from app.distributed import wire


@dataclass
class World:
    """This process's place in the run."""
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str
    launcher: str
    description: str
    """How the run was started and laid out, for the start-up line."""
    node: str = ""


def rank() -> int:
    """Global rank (0 before the group exists)."""
    return torch_dist.get_rank() if torch_dist.is_initialized() else int(os.environ.get("RANK", "0"))


def world_size() -> int:
    """Number of ranks (1 before the group exists)."""
    return torch_dist.get_world_size() if torch_dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def is_main() -> bool:
    """True on the rank that prints and writes files."""
    return rank() == 0


def print0(*args, **kwargs):
    """print on the main rank only."""
    if is_main():
        print(*args, **kwargs, flush=True)


# The host group: gloo on the CPU, beside the device group (NCCL on GPUs) that carries the engine's tensors.
# The app's own few numbers (stop votes, summary peaks, probes, checkpoint agreement) travel here, so the
# device group never sees a CPU tensor and no bookkeeping waits on the device.
_host = None


def start_host_group(timeout: datetime.timedelta = None):
    """Create the host group; every rank calls it once, right after the process group starts."""
    global _host
    if many():
        _host = torch_dist.new_group(backend="gloo", timeout=timeout)


def many() -> bool:
    """Whether the run has more than one rank: with one, nothing needs a collective."""
    return torch_dist.is_initialized() and torch_dist.get_world_size() > 1


def _host_group():
    if _host is None:
        raise RuntimeError("the host group was not started: call dist.start_host_group() after the process group")
    return _host


def barrier():
    """Wait for every rank, on the host group (a no-op without a process group)."""
    if many():
        torch_dist.barrier(group=_host_group())


@contextlib.contextmanager
def main_process_first():
    """Let rank 0 run the block (downloads, caches) before the others do."""
    if not is_main():
        barrier()
    try:
        yield
    finally:
        if is_main():
            barrier()


def _host_reduce(values, op) -> list:
    numbers = torch.tensor([float(v) for v in values], dtype=torch.float64)  # on the CPU, the host group's device
    if many():
        torch_dist.all_reduce(numbers, op=op, group=_host_group())
    return numbers.tolist()


def host_sum(values) -> list:
    """Element-wise sums of a few Python numbers over every rank, on the host group."""
    return _host_reduce(values, torch_dist.ReduceOp.SUM)


def host_max(values) -> list:
    """Element-wise maxima of a few Python numbers over every rank, on the host group."""
    return _host_reduce(values, torch_dist.ReduceOp.MAX)


def group_sum(part: torch.Tensor, group) -> torch.Tensor:
    """part summed over the ranks of group, its gradient passed back to part unchanged: every rank of the group
    computes the same loss from the sum, so each rank's part takes the loss's gradient once (an all-reduce of the
    gradients, torch.distributed.nn's, would count it once per rank)."""
    return _GroupSum.apply(part, group)


class _GroupSum(torch.autograd.Function):
    """group_sum's forward and backward."""

    @staticmethod
    def forward(ctx, part: torch.Tensor, group) -> torch.Tensor:
        whole = part.clone()
        torch_dist.all_reduce(whole, group=group)
        return whole

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def group_gather(part: torch.Tensor, group) -> torch.Tensor:
    """Every rank of group's part (one shape on each), concatenated along the first dimension in rank order."""
    parts = [torch.empty_like(part) for _ in range(torch_dist.get_world_size(group))]
    torch_dist.all_gather(parts, part.contiguous(), group=group)
    return torch.cat(parts)


def broadcast_object(obj):
    """rank 0's obj (a JSON value) on every rank, over the host group."""
    return gather_objects(obj if is_main() else None)[0] if many() else obj


def gather_objects(obj) -> list:
    """Every rank's obj (a JSON value), in rank order, on every rank, over the host group: sent as JSON, since
    torch's object collectives unpickle what arrives."""
    if not many():
        return [obj]
    data = torch.frombuffer(bytearray(wire.encode(obj)), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(torch_dist.get_world_size())]
    torch_dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), group=_host_group())
    padded = torch.zeros(max(int(size) for size in sizes), dtype=torch.uint8)
    padded[:data.numel()] = data
    gathered = [torch.empty_like(padded) for _ in sizes]
    torch_dist.all_gather(gathered, padded, group=_host_group())
    return [wire.decode(got[:int(size)].numpy().tobytes(), f"a message from rank {r}")
            for r, (got, size) in enumerate(zip(gathered, sizes))]


def teardown():
    """Leave the process group (and the host group); safe to call when none exists."""
    global _host
    if torch_dist.is_initialized():
        torch_dist.destroy_process_group()
    _host = None
