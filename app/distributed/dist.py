"""Run time inside the process group: who this rank is, printing from the main rank, collectives, teardown.

Every collective of the app goes through here (DeepSpeed's own, in app/ds/internals/, excepted).

Launch time (which launcher, its variables, the start-up rendezvous) lives in app/distributed/launch.py.
"""
import contextlib
import datetime
import os
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from app.ds.internals import torch_private
from app.distributed import wire
from app.errors import RankAlone, SaidByAnotherRank, UserError


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


# The host group: gloo on the CPU, beside the device group (NCCL on GPUs) that carries the engine's tensors.
# The app's own few numbers (stop votes, summary peaks, probes, checkpoint agreement) travel here, so the
# device group never sees a CPU tensor and no bookkeeping waits on the device.
_host = None


def start_host_group(timeout: datetime.timedelta = None):
    """Create the host group; every rank calls it once, right after the process group starts."""
    global _host
    if _many():
        _host = dist.new_group(backend="gloo", timeout=timeout)


def _many() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def _host_group():
    if _host is None:
        raise RuntimeError("the host group was not started: call dist.start_host_group() after the process group")
    return _host


def barrier():
    """Wait for every rank, on the host group (a no-op without a process group)."""
    if _many():
        dist.barrier(group=_host_group())


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
    if _many():
        dist.all_reduce(numbers, op=op, group=_host_group())
    return numbers.tolist()


def host_sum(values) -> list:
    """Element-wise sums of a few Python numbers over every rank, on the host group."""
    return _host_reduce(values, dist.ReduceOp.SUM)


def host_max(values) -> list:
    """Element-wise maxima of a few Python numbers over every rank, on the host group."""
    return _host_reduce(values, dist.ReduceOp.MAX)


def broadcast_object(obj):
    """rank 0's obj (a JSON value) on every rank, over the host group."""
    return gather_objects(obj if is_main() else None)[0] if _many() else obj


def gather_objects(obj) -> list:
    """Every rank's obj (a JSON value), in rank order, on every rank, over the host group: sent as JSON, since
    torch's object collectives unpickle what arrives."""
    if not _many():
        return [obj]
    data = torch.frombuffer(bytearray(wire.encode(obj)), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), group=_host_group())
    padded = torch.zeros(max(int(size) for size in sizes), dtype=torch.uint8)
    padded[:data.numel()] = data
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded, group=_host_group())
    return [wire.decode(got[:int(size)].numpy().tobytes(), f"a message from rank {r}")
            for r, (got, size) in enumerate(zip(gathered, sizes))]


# Outcomes of a step that may fail on some ranks only (a micro batch trial, the first compiled step, the
# error that ends training) travel through the rendezvous store rather than a collective, so that a rank
# whose part failed can bound its wait: the others may be blocked in a collective of that step (ZeRO-3's
# gathers, a gradient all-reduce) that it left, and would never come. They are JSON: the store has no
# authentication and listens on the network, so whatever its port receives must not be able to run code.
_rounds = 0
_LEFT = "app/left"
_left = False  # this rank left (leave())
_note = None  # why another rank left, read from the store each second: the store may go with rank 0
_foreign = None  # the UserError of a value in the store that no rank of this run wrote, as the watcher met it


@contextlib.contextmanager
def watching_for_leavers():
    """Around work a rank may leave alone (the micro batch search, training): a thread reads the store each
    second for a note from a rank that left, so that this rank knows it when its collective fails as that
    rank goes, even if the store went with it (rank 0 serves it). Stopped at the block's end, before any
    rank of a run that went well can end and take the store."""
    if not _many():
        yield
        return
    stop = threading.Event()
    thread = threading.Thread(target=_watch, args=(torch_private.default_store(), stop),
                              name="app-leavers", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)


def _watch(store, stop: threading.Event):
    global _note, _foreign
    while not stop.wait(1.0):
        try:
            _note = _read_note(store)
        except dist.DistError:  # the store went (rank 0 ended): nothing more to read
            return
        except UserError as e:  # said by the main thread at its next look (_left_note)
            _foreign = e
            return
        if _note is not None:
            return


def _read_note(store):
    """The note a rank that left put in the store, or None; one line when it is not one the app wrote."""
    if not store.check([_LEFT]):
        return None
    note = wire.decode(store.get(_LEFT), f"the rendezvous store's key {_LEFT}")
    if not isinstance(note, str):
        raise UserError(f"the rendezvous store's key {_LEFT} holds a value this run's ranks did not write; "
                        f"firewall the store's port (README \"Trust\")")
    return note


def _outcome(raw: bytes, key: str) -> tuple:
    """A rank's outcome as gather_outcomes posted it: a JSON list, returned as a tuple."""
    said = wire.decode(raw, f"the rendezvous store's key {key}")
    return tuple(said) if isinstance(said, list) else said


def gather_outcomes(mine, failed_after_s: float = None, patience_s: float = 30):
    """Every rank's outcome of a step (a tuple of JSON values), in rank order.

    failed_after_s: this rank's part failed that many seconds in. It then waits for the others at most
    patience_s + 10x that (their part is the same work) and gets None if they have not all said theirs: they are
    blocked where it left them, and it should end the run with leave(). A rank that finds another has left
    ends quietly (SaidByAnotherRank): that rank said why."""
    global _rounds
    if not _many():
        return [mine]
    _rounds += 1
    keys = [f"app/outcome/{_rounds}/{r}" for r in range(dist.get_world_size())]
    try:
        store = torch_private.default_store()
        store.set(keys[dist.get_rank()], wire.encode(mine))
        if failed_after_s is None:
            store.wait(keys)  # as long as the group's timeout
        else:
            deadline = time.monotonic() + patience_s + 10 * failed_after_s
            while not store.check(keys):  # polled: a wait that times out has the store log warnings
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.05)
        said = [_outcome(store.get(key), key) for key in keys]
    except dist.DistError:  # the store went with rank 0
        said = None
        if failed_after_s is None and _note is None:
            raise
    note = _left_note()
    if note is not None:
        raise SaidByAnotherRank(note)
    return said  # None: a failed rank says its own error, alone


def another_rank_left() -> bool:
    """Whether a rank has left the run alone (leave()): a collective failing here is its going. Not when the
    store went with rank 0 and no note was read from it before: that may be a crash, which a restart (exit 1,
    not 2) should follow."""
    return _many() and _left_note() is not None


def _left_note():
    """Why another rank left: as the watcher read it, or from the store; None if none did (or it is gone)."""
    if _foreign is not None:
        raise _foreign
    if _note is not None:
        return _note
    with contextlib.suppress(dist.DistError):
        return _read_note(torch_private.default_store())
    return None


def leave(why: str) -> RankAlone:
    """The error that ends this rank alone, saying why at once; the others, if their collectives fail as
    this rank goes (gloo's do), find it in gather_outcomes and end without a second line."""
    global _left
    with contextlib.suppress(dist.DistError):
        torch_private.default_store().set(_LEFT, wire.encode(why))
        _left = True
    return RankAlone(why)


class HostVote:
    """A yes/no vote of every rank on the host group that never waits: each call posts this rank's vote and
    returns the result of the vote posted one call earlier (True when any rank voted yes)."""

    def __init__(self):
        self.ballot = torch.zeros(1, dtype=torch.int32)  # on the CPU: the host group's device
        self.pending = None

    def exchange(self, yes: bool) -> bool:
        """Post this rank's vote; the previous round's outcome (without other ranks: this vote)."""
        if not _many():
            return yes
        outcome = False
        if self.pending is not None:
            self.pending.wait()  # posted a step ago by every rank, so done by now
            outcome = bool(self.ballot.item())
        self.ballot.fill_(int(yes))
        self.pending = dist.all_reduce(self.ballot, op=dist.ReduceOp.MAX, group=_host_group(), async_op=True)
        return outcome

    def finish(self):
        """Complete the last posted round, so no collective is left in flight at teardown."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None


def teardown():
    """Leave the process group (and the host group); safe to call when none exists."""
    global _host, _left, _note, _foreign
    if _left:  # rank 0 serves the store: the others' watchers read the note before it goes with this process
        time.sleep(2.5)
    if dist.is_initialized():
        dist.destroy_process_group()
    _host, _left, _note, _foreign = None, False, None, None
