"""The largest micro batch that fits, found at start by every rank together.

"train_micro_batch_size_per_gpu": "auto" beside the global batch in "train_batch_size": before training, the app
tries micro batches with real steps (a forward, a backward and an optimizer step, each on an engine of its own),
and takes the largest that runs on every rank; an out-of-memory error on any rank counts for all. Gradient
accumulation makes up the rest of the global batch, which never changes, so the candidates are the divisors of
the global batch over the data-parallel replicas, searched by halving. The trials leave no trace: their engines
go, the random generators are as they were, and the run's model is built afterwards as if there had been none.
A resume takes the micro batch its checkpoint recorded, without searching again.

Each trial's ranks agree after its forward pass, before the gradients are reduced, and after its step: an
out-of-memory error there on any rank is agreed without a wait. When one rank alone fails where the others go
on into a collective of the step (its backward's gradient reduction, ZeRO-3's gathers, tensor-parallel
all-reduces), they cannot agree any more: the failed rank waits for them a bounded time, then ends the run
with one line saying which micro batch to write instead, and the launcher ends the others.
"""
import contextlib
import io
import json
import random
import time

import numpy as np
import torch

from app.distributed import dist, endings
from app.ds import internals as ds_internals
from app.ds import run_dict
from app.core import loop
from app.checkpoint.save import STATE, checkpoint_root, complete_checkpoints
from app.core.compiling import describe
from app.data.loader import build_loader
from app.ds.config import MICRO, resolve_batch_sizes
from app.errors import UserError, one_value_per_channel
from app.observe.metrics import reset_peak_memory
from app.checkpoint.resume import checkpoint_folder


def wanted(ds: dict) -> bool:
    return ds.get(MICRO) == "auto"


def candidates(global_batch: int, replicas: int) -> list:
    """The micro batches that split the global batch evenly over the replicas, smallest first."""
    share = global_batch // replicas
    return [m for m in range(1, share + 1) if share % m == 0]


def largest(sizes: list, runs) -> tuple:
    """(the largest of sizes for which runs(size) says '', {size: why it did not run}); sizes ascending and what
    fits shrinking with size. The whole share is tried first: no accumulation at all is the best outcome."""
    failed, low, high = {}, -1, len(sizes) - 1
    why = runs(sizes[high])
    if not why:
        return sizes[high], failed
    failed[sizes[high]] = why
    while high - low > 1:
        middle = (low + high) // 2
        why = runs(sizes[middle])
        if why:
            failed[sizes[middle]], high = why, middle
        else:
            low = middle
    return (sizes[low] if low >= 0 else 0), failed


def settle(ds: dict, where: str, layout, task, build, train_set, output_dir, resumed: str, board) -> dict:
    """ds with its micro batch and accumulation: as written, from the checkpoint resumed, or found now.
    build(ds) makes a fresh model, laid out for an engine of ds; board: the run's endings.Board, where the ranks
    agree on each trial."""
    if not wanted(ds):
        return ds
    total, replicas = ds["train_batch_size"], layout.replicas
    sizes = candidates(total, replicas)
    saved, folder = _saved_micro(output_dir, resumed)
    if saved in sizes:
        dist.print0(f"micro batch: {saved} from {folder} (\"auto\" found it when the run began), "
                    f"{total // (saved * replicas)} accumulation step(s)")
        return resolve_batch_sizes({**ds, MICRO: saved}, replicas, where)
    ran = []

    def runs(size: int) -> str:
        why = _trial(ds, size, layout, task, build, train_set, where, max(ran, default=0), board)
        ran.extend([] if why else [size])
        return why
    with _generators_kept():
        micro, failed = largest(sizes, runs)
    if not micro:
        raise UserError(f"{where}: not even a micro batch of 1 fits: {failed[1]}; use a config that holds less "
                        f"per rank (python -m app.tools.plan shows which) or a GPU with more memory")
    tried = ", ".join(f"{size}: {why}" for size, why in sorted(failed.items()))
    dist.print0(f"micro batch: \"auto\" picked {micro}, the largest of {', '.join(map(str, sizes))} that runs on "
                f"every rank{f' ({tried})' if tried else ''}; {total // (micro * replicas)} accumulation step(s) x "
                f"{replicas} replica(s) keep the global batch {total}")
    return resolve_batch_sizes({**ds, MICRO: micro}, replicas, where)


def _saved_micro(output_dir, resumed: str) -> tuple:
    """(micro batch, checkpoint folder) that the checkpoint a resume would take recorded, or (None, None)."""
    if not resumed:
        return None, None
    with contextlib.suppress(OSError, ValueError, KeyError, UserError):
        folder = (complete_checkpoints(checkpoint_root(output_dir)) or [None])[-1] if resumed == "auto" else \
            checkpoint_folder(resumed)
        if folder is not None:
            saved = json.loads((folder / STATE).read_text())["deepspeed_config"].get(MICRO)
            return saved, folder
    return None, None


def _trial(ds: dict, micro: int, layout, task, build, train_set, where: str, ran: int, board) -> str:
    """'' when a forward, backward and optimizer step of `micro` samples ran on every rank, else why not;
    ran: the largest micro batch that ran so far (0: none), for the line of a rank that must end the run."""
    trial = run_dict.for_trial(ds, micro, layout.replicas)
    try:
        return _trial_steps(trial, micro, layout, task, build, train_set,
                            lambda part: _agreed(part, micro, where, ran, board))
    finally:  # the trial's frame is gone: its engine is garbage now, unless DeepSpeed's globals still hold it
        task.after_trial()  # what a trial that ran out of memory left gathered in the task's own engines
        ds_internals.forget_parallel_groups()
        ds_internals.forget_unfinished_forward()
        here = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        reset_peak_memory(here)  # the trial's memory given back: collected, the heap trimmed, the cache emptied


def _trial_steps(trial: dict, micro: int, layout, task, build, train_set, agreed) -> str:
    """A forward, backward and optimizer step of `micro` samples on an engine of its own; '' or why it failed."""
    with contextlib.redirect_stdout(io.StringIO()):  # each trial engine's start-up lines are the run's already
        module = build(trial)
        engine = loop.build_engine(module, run_dict.for_engine(trial, run_dict.trainable(module), layout.tensor))
        step = layout.train_step(engine, task, False)
    try:
        batch = next(iter(build_loader(train_set, micro, layout.replica, layout.replicas, False, 0)))
        for part in step.trial_parts(batch):
            why = agreed(part)
            if why:
                return why
        return ""
    finally:
        engine.destroy()  # its hooks on the parameters (held by torch's autograd, out of gc's sight) go


def _outcome(part) -> tuple:
    """('', '') when part() ran, ('memory', what ran out) when it ran out of memory, ('fatal', what) else."""
    try:
        part()
        return "", ""
    except Exception as e:  # noqa: BLE001 (sorted: out of memory, or the run's end agreed by every rank)
        said, e = endings.out_of_memory(e), one_value_per_channel(e) or e
        return ("memory", said) if said else ("fatal", str(e) if isinstance(e, UserError) else describe(e))


def _agreed(part, micro: int, where: str, ran: int, board) -> str:
    """Run part() on every rank: '' when it ran on all, else the first rank's out-of-memory error, named. Any
    other error ends the run in one line naming the rank; so does a rank that failed alone where the others
    went on into a collective of the step and cannot come to agree."""
    started = time.perf_counter()
    kind, why = _outcome(part)
    said = board.outcomes((kind, why), time.perf_counter() - started if kind else None)
    if said is None:
        what = f"ran out of memory with a micro batch of {micro} ({why})" if kind == "memory" else \
            f"failed with a micro batch of {micro} ({why})"
        instead = f"{ran}, the largest that ran on every rank" if ran else f"less than {micro}"
        raise board.alone(f"the micro batch search ended: rank {dist.rank()} {what} while the other ranks went "
                          f"on into that step's collectives, so they cannot agree on a smaller one; set "
                          f"train_micro_batch_size_per_gpu in {where} to {instead}")
    fatal = [(rank, text) for rank, (kind, text) in enumerate(said) if kind == "fatal"]
    if fatal:
        raise UserError(f"the micro batch search failed on rank {fatal[0][0]} with a micro batch of {micro}: "
                        f"{fatal[0][1]}")
    return next((f"{text} on rank {rank}" for rank, (kind, text) in enumerate(said) if kind), "")


@contextlib.contextmanager
def _generators_kept():
    """Python's, numpy's and torch's random generators (CUDA's too) as they were before the block."""
    python, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if torch.cuda.is_available() else []):
        yield
    random.setstate(python)
    np.random.set_state(numpy_state)
