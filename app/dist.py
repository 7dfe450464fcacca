"""Run time inside the process group: who this rank is, printing from the main rank, collectives, teardown.

Launch time (which launcher, its variables, the start-up rendezvous) lives in app/launch.py.
"""
import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


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
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def world_size() -> int:
    """Number of ranks (1 before the group exists)."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def is_main() -> bool:
    """True on the rank that prints and writes files."""
    return rank() == 0


def print0(*args, **kwargs):
    """print on the main rank only."""
    if is_main():
        print(*args, **kwargs, flush=True)


def barrier():
    """Wait for every rank (a no-op without a process group)."""
    if dist.is_initialized():
        dist.barrier()


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


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over all ranks in place and return it."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum over all ranks, in place."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def broadcast_object(obj):
    """rank 0's obj on every rank."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def teardown():
    """Leave the process group; safe to call when none exists."""
    if dist.is_initialized():
        dist.destroy_process_group()
