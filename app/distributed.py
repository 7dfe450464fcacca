"""Who am I, which device, which backend. The only module that reads launcher variables."""
import contextlib
import datetime
import logging
import os
import socket
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from app.errors import UserError


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
    reason: str


def detect_launcher(env=os.environ) -> str:
    """Name the launcher that started this process, or 'none'."""
    if "RANK" in env and "WORLD_SIZE" in env:
        if "TORCHELASTIC_RUN_ID" in env:
            return "torchrun"
        if "CROSS_RANK" in env or "LOCAL_SIZE" in env:
            return "deepspeed"
        return "env"
    return "none"


def plan_without_launcher(gpu_count: int, single_process: bool) -> tuple:
    """Decide ('cpu' | 'gpu' | 'relaunch', reason) when no launcher started us."""
    if gpu_count == 0:
        return "cpu", "no launcher and no GPU: one CPU process with gloo"
    if gpu_count == 1:
        return "gpu", "no launcher and one GPU: plain single-device training on cuda:0"
    if single_process:
        return "gpu", f"no launcher, {gpu_count} GPUs, --single_process: one process on cuda:0"
    return "relaunch", f"no launcher and {gpu_count} GPUs: relaunching through the deepspeed launcher on all of them"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody is listening on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _relaunch():
    """Replace this process with the deepspeed launcher running the same command on every GPU."""
    argv = [sys.executable, "-u", "-m", "deepspeed.launcher.runner", sys.argv[0], *sys.argv[1:]]
    sys.stdout.flush()
    os.execv(sys.executable, argv)


def prepare_environment():
    """Settle what DeepSpeed reads from the environment before it is imported."""
    # JIT op builds run `ninja` from PATH; two ninjas (system and venv) disagree on their build logs
    # and rebuild every op from scratch each time the other one ran, so always use this Python's own.
    bin_dir = os.path.dirname(sys.executable)
    if not os.environ.get("PATH", "").startswith(bin_dir + os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    # Name DeepSpeed's accelerator when there is no GPU, sparing every rank its detection warning.
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def setup(single_process: bool = False, timeout_s: int = 600) -> World:
    """Join (or create) the process group through deepspeed.init_distributed and pick the device."""
    import deepspeed
    launcher = detect_launcher()
    if launcher == "none":
        mode, reason = plan_without_launcher(torch.cuda.device_count(), single_process)
        if mode == "relaunch":
            print(reason, flush=True)
            _relaunch()
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    else:
        reason = f"started by {launcher}"
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise UserError(f"local rank {local_rank} has no GPU: this node has {torch.cuda.device_count()}; "
                            f"start at most that many processes per node")
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        if "OMP_NUM_THREADS" not in os.environ:  # ranks on one node share its cores instead of fighting
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    deepspeed.utils.logger.setLevel(logging.WARNING if rank == 0 else logging.ERROR)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False,
                               timeout=datetime.timedelta(seconds=timeout_s))
    _drop_deepspeed_shm_names(rank, local_world_size == world_size)
    reason += f"; {world_size} rank(s), {backend} on {device.type}"
    return World(rank, local_rank, world_size, local_world_size, device, backend, launcher, reason)


def _drop_deepspeed_shm_names(rank: int, all_local: bool):
    """Remove the name of this rank's /dev/shm segment once every rank has mapped them all.

    On CPU, DeepSpeed's comm backend gives each rank of an all-local group a 69 MB shared-memory
    segment (for its inference all-reduce) and never removes it: every run would leave them behind
    until /dev/shm fills the machine's memory. The mappings stay valid after the name is gone.
    """
    path = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_" \
           f"{os.environ.get('MASTER_PORT')}_{rank}"
    if torch.cuda.is_available() or not all_local:
        return
    barrier()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


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
