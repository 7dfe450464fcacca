"""How a run ends when a rank fails: in one line, said once, and never a hang.

A failure may end a step on some ranks only (an out-of-memory micro batch, a damaged file a loader found, a
compile refused on one rank) while the others are blocked in a collective of that step. The ranks' outcomes
therefore travel through the rendezvous store, where a failed rank can bound its wait, rather than through a
collective. The words used:
- an outcome: what one rank says of a step, ("", "") when it went well, else (kind, why);
- a leaver: a rank that ends alone (RankAlone) because the others cannot come to agree; it says its line at
  once and leaves a note (why) in the store;
- a rank whose collective fails as a leaver goes finds the note and ends without a line of its own
  (SaidByAnotherRank), so one failure is one line.
The store values are JSON (app/distributed/wire.py): the store has no authentication and listens on the network.
"""
import contextlib
import threading
import time

import torch
import torch.distributed as torch_dist

from app.distributed import dist, preemption, wire
from app.ds.internals import torch_private
from app.errors import RankAlone, SaidByAnotherRank, UserError, deepspeed_failure

MEMORY_ADVICE = ("lower train_micro_batch_size_per_gpu in the ds_config (\"auto\" with train_batch_size finds the "
                 "largest that fits), add \"activation_checkpointing\": {}, or take a config that holds less per "
                 "rank: python -m app.tools.plan shows which fits")
"""What to change when a run's step runs out of memory."""


def out_of_memory(error: BaseException) -> str:
    """What ran out, when error (or what it was raised from) is an out-of-memory error of the device or of the
    CPU allocator (which says it in a RuntimeError); else ''."""
    while error is not None:
        if isinstance(error, torch.OutOfMemoryError):
            return (str(error).strip().splitlines() or ["out of memory"])[0][:200]
        if isinstance(error, RuntimeError) and "can't allocate memory" in str(error):
            said = (str(error).strip().splitlines() or [""])[0].split("DefaultCPUAllocator: ")[-1][:160]
            return said if "out of memory" in said.lower() else f"out of memory ({said})"
        error = error.__cause__ or error.__context__
    return ""


_LEFT = "app/left"
_READ = "app/left/read"  # how many other ranks have read the note
LINGER_S = 2.5  # the most a rank that left waits for the others to read its note (they look each second)


class _Leavers:
    """What this process knows of ranks that left, until the run's end (close())."""
    def __init__(self):
        self.rounds = 0  # outcomes gathered so far: each round has keys of its own
        self.left = False  # this rank left (leave())
        self.acknowledged = False  # this rank read a leaver's note and said so (_READ)
        self.note = None  # why another rank left, read from the store each second: the store may go with rank 0
        self.foreign = None  # the UserError of a store value no rank of this run wrote, as the watcher met it


_known = _Leavers()


@contextlib.contextmanager
def watching_for_leavers():
    """Around work a rank may leave alone (the micro batch search, training): a thread reads the store each
    second for a note from a rank that left, so that this rank knows it when its collective fails as that
    rank goes, even if the store went with it (rank 0 serves it). Stopped at the block's end, before any
    rank of a run that went well can end and take the store."""
    if not dist.many():
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
    while not stop.wait(1.0):
        try:
            _known.note = _read_note(store)
        except torch_dist.DistError:  # the store went (rank 0 ended): nothing more to read
            return
        except UserError as e:  # said by the main thread at its next look (_left_note)
            _known.foreign = e
            return
        if _known.note is not None:
            return


def _read_note(store):
    """The note a rank that left put in the store, or None; one line when it is not one the app wrote. A note
    read is acknowledged once (_READ), so the rank that left need not linger longer."""
    if not store.check([_LEFT]):
        return None
    note = wire.decode(store.get(_LEFT), f"the rendezvous store's key {_LEFT}")
    if not isinstance(note, str):
        raise UserError(f"the rendezvous store's key {_LEFT} holds a value this run's ranks did not write; "
                        f"firewall the store's port (docs/trust.md)")
    if not _known.acknowledged:
        store.add(_READ, 1)
        _known.acknowledged = True
    return note


def _outcome(raw: bytes, key: str) -> tuple:
    """A rank's outcome as gather_outcomes posted it: a JSON list, returned as a tuple."""
    said = wire.decode(raw, f"the rendezvous store's key {key}")
    return tuple(said) if isinstance(said, list) else said


def gather_outcomes(mine, failed_after_s: float = None, patience_s: float = 30):
    """Every rank's outcome of a step (a tuple of JSON values), in rank order.

    failed_after_s: this rank's part failed that many seconds in. It then waits for the others at most
    patience_s + 10x that (their part is the same work) and gets None if they have not all said theirs: they are
    blocked where it left them, and it should end the run with leave(). It waits no longer once a stop is asked of
    it (a launcher ends every rank when one dies). A rank that finds another has left ends quietly
    (SaidByAnotherRank): that rank said why."""
    if not dist.many():
        return [mine]
    _known.rounds += 1
    keys = [f"app/outcome/{_known.rounds}/{r}" for r in range(torch_dist.get_world_size())]
    try:
        store = torch_private.default_store()
        store.set(keys[torch_dist.get_rank()], wire.encode(mine))
        if failed_after_s is None:
            store.wait(keys)  # as long as the group's timeout
        else:
            deadline = time.monotonic() + patience_s + 10 * failed_after_s
            while not store.check(keys):  # polled: a wait that times out has the store log warnings
                if time.monotonic() > deadline or preemption.asked():
                    return None
                time.sleep(0.05)
        said = [_outcome(store.get(key), key) for key in keys]
        _read_by_all(store, [f"{key}/read" for key in keys])
    except torch_dist.DistError:  # the store went with rank 0
        said = None
        if failed_after_s is None and _known.note is None:
            raise
    note = _left_note()
    if note is not None:
        raise SaidByAnotherRank(note)
    return said  # None: a failed rank says its own error, alone


def _read_by_all(store, keys: list, wait_s: float = 10):
    """Every rank marks the outcomes read; rank 0, whose process serves the store, then waits for all the marks
    (bounded; not for a rank that gave up waiting and left), so that an outcome that ends the run does not take
    the store with it before a rank has read it (that rank would then end alone, with a line of its own)."""
    with contextlib.suppress(torch_dist.DistError):  # read already: a store gone by now changes nothing here
        store.set(keys[torch_dist.get_rank()], b"1")
    deadline = time.monotonic() + wait_s
    while torch_dist.get_rank() == 0 and not store.check(keys) and not store.check([_LEFT]) and \
            time.monotonic() < deadline:
        time.sleep(0.005)


def another_rank_left() -> bool:
    """Whether a rank has left the run alone (leave()): a collective failing here is its going. Not when the
    store went with rank 0 and no note was read from it before: that may be a crash, which a restart (exit 1,
    not 2) should follow."""
    return dist.many() and _left_note() is not None


def _left_note():
    """Why another rank left: as the watcher read it, or from the store; None if none did (or it is gone)."""
    if _known.foreign is not None:
        raise _known.foreign
    if _known.note is not None:
        return _known.note
    with contextlib.suppress(torch_dist.DistError):
        return _read_note(torch_private.default_store())
    return None


def leave(why: str) -> RankAlone:
    """The error that ends this rank alone, saying why at once; the others, if their collectives fail as
    this rank goes (gloo's do), find it in gather_outcomes and end without a second line."""
    with contextlib.suppress(torch_dist.DistError):
        torch_private.default_store().set(_LEFT, wire.encode(why))
        _known.left = True
    return RankAlone(why)


def close():
    """At the run's end: a rank that left lingers until every other rank has read its note, or LINGER_S (rank 0
    serves the store, which goes with its process; a rank that died never reads it), and not once a stop is asked
    of it (its launcher is ending every rank); what was known of leavers is forgotten (another job may follow)."""
    global _known
    if _known.left and torch_dist.is_initialized():
        deadline = time.monotonic() + LINGER_S
        with contextlib.suppress(torch_dist.DistError):
            store, others = torch_private.default_store(), torch_dist.get_world_size() - 1
            while store.add(_READ, 0) < others and time.monotonic() < deadline and not preemption.asked():
                time.sleep(0.02)
    _known = _Leavers()


@contextlib.contextmanager
def one_line_on_failure(engine, began):
    """Around training: an error that ends the run on some ranks (out of memory, a damaged file a loader found,
    a feature of the JSON DeepSpeed fails on) becomes one line, agreed by the ranks it ended together (rank 0
    says it), or said at once by a rank it ended alone while the others went on into a collective of the step,
    where they wait for it; they end without a line. began() is when the step under way began."""
    with watching_for_leavers():
        try:
            yield
        except (RankAlone, SaidByAnotherRank):
            raise
        except Exception as e:  # noqa: BLE001 (sorted: the run's end in one line, or not the app's to say)
            said = out_of_memory(e)
            e = e if said else deepspeed_failure(e, f"in training step {engine.global_steps + 1}") or e
            if said or isinstance(e, UserError):
                raise _ended(engine, began(), "memory" if said else "error", said or str(e)) from None
            if another_rank_left():
                raise SaidByAnotherRank(str(e)) from None
            raise


def _ended(engine, began: float, kind: str, why: str) -> UserError:
    """The error that ends the run from this rank: agreed with the ranks that failed too, which fail within a
    step of each other (only they post an outcome), or this rank's alone."""
    outcomes = gather_outcomes((kind, why), time.perf_counter() - began, patience_s=5)
    alone = outcomes is None
    kind, why = (kind, why) if alone else outcomes[0]
    if kind == "error":
        return leave(why) if alone else UserError(why)
    who = f"rank {torch_dist.get_rank()}" if alone else "every rank" if len(outcomes) > 1 else "the run"
    where = " while the other ranks went on into that step's collectives" if alone else ""
    said = f"{who} ran out of memory after {engine.global_steps} step(s) ({why}){where}; {MEMORY_ADVICE}"
    return leave(said) if alone else UserError(said)
