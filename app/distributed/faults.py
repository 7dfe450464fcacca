"""Fault points the tests switch on through the environment, to make a chosen rank fail at a chosen moment.

    APP_KILL_AT=<moment>:<step>[:<rank>]      SIGKILL at a moment of a checkpoint save (shards, manifest, pointer),
                                              in a first attempt only (not in a restarted one)
    APP_OOM_AT=<micro batch>[:<rank>[:backward]]   raise torch.OutOfMemoryError in a forward (or backward) of that
                                              many samples or more
    APP_FAIL_COMPILE=<forward|backward>[:<rank>]   make inductor refuse the model's forward or backward graph
    APP_PATIENCE_S=<seconds>                  how long a rank that failed alone waits for the others to say
                                              theirs (instead of the 5 to 300 s each agreement sets)

Unset (as for every user), each is a no-op.
"""
import os
import signal

import torch

from app.distributed import dist


def _wanted(name: str, before_rank: int = 1) -> list:
    """The fields of fault point `name` when it is set for this rank (the field after the first before_rank
    fields names one rank; none or empty means every rank), else []."""
    fields = os.environ.get(name, "").split(":")
    if not fields[0] or (len(fields) > before_rank and fields[before_rank] and int(fields[before_rank]) != dist.rank()):
        return []
    return fields


def kill_at(moment: str, step: int):
    """SIGKILL this rank here when APP_KILL_AT names this moment and step (the crash-safety tests use it); only
    in a first attempt, so a run restarted by torchrun --max_restarts or app.tools.restart gets past it."""
    restarted = any(os.environ.get(name, "0") != "0" for name in ("TORCHELASTIC_RESTART_COUNT", "APP_RESTART_COUNT"))
    wanted = _wanted("APP_KILL_AT", 2)
    if wanted and not restarted and wanted[0] == moment and int(wanted[1]) == step:
        os.kill(os.getpid(), signal.SIGKILL)


def out_of_memory_at(micro_batch: int, output: torch.Tensor = None):
    """Raise the error a device out of memory raises, when APP_OOM_AT says this micro batch is too large here:
    in the forward, or with ':backward' when the backward pass reaches the forward's `output`."""
    wanted = _wanted("APP_OOM_AT")
    if not wanted or micro_batch < int(wanted[0]) or (wanted[2:] == ["backward"]) != (output is not None):
        return
    error = torch.OutOfMemoryError(f"out of memory: APP_OOM_AT={os.environ['APP_OOM_AT']} refuses a micro batch "
                                   f"of {micro_batch}")
    if output is None:
        raise error

    def refuse(grad):
        raise error
    if output.requires_grad:
        output.register_hook(refuse)


def patience_s(default: float) -> float:
    """The bounded wait of a rank that failed alone: default, or APP_PATIENCE_S (so a test waits seconds)."""
    return float(os.environ.get("APP_PATIENCE_S") or default)


def compile_backend():
    """What torch.compile is given: inductor, or inductor refusing the graph APP_FAIL_COMPILE names."""
    wanted = _wanted("APP_FAIL_COMPILE")
    if not wanted:
        return "inductor"
    from app.ds.internals.torch_private import inductor_refusing
    refuse_backward = wanted[0] == "backward"

    def refuse(is_backward: bool):
        if is_backward == refuse_backward:
            raise RuntimeError(f"APP_FAIL_COMPILE: inductor refuses this {wanted[0]} graph on rank {dist.rank()}")
    return inductor_refusing(refuse)
