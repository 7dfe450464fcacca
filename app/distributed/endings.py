"""How a run ends, and every agreement of its ranks on it: through the rendezvous store, in one line, never a hang.

A rank that failed cannot join a collective its peers are blocked in, but it can reach the store (rank 0 serves it)
and bound how long it waits there. So the ranks of a run agree through the store (docs/endings.md):

- rounds: at an agreement point each rank posts its outcome, ("", "") or (kind, why), and reads everyone's. A rank
  whose part failed waits a bounded time: past it, the others are blocked in a collective of the step it left;
- ending alone: that rank posts why, says its line at once (Ended(alone=True)) and ends. A rank whose collective
  then fails as it goes finds why in the store and ends without a line (the store outlives rank 0 a while:
  wire.open_store);
- the stop step: a rank asked to stop posts the step at which every rank stops, two ahead of its own (no rank is
  more than one step from another), and each reads it at every step boundary;
- the start: each rank checks in, or posts the mistake that ended it before it could (launch.said_before_start);
  rank 0 says who did not start, or why, and the others end without a line.
Values are JSON (app/distributed/wire.py): the store has no authentication and listens on the network.
"""
import contextlib
import datetime
import time

import torch
import torch.distributed as torch_dist

from app.distributed import dist, wire
from app.ds import internals as ds_internals
from app.ds.internals import torch_private
from app.errors import Ended, UserError, deepspeed_failure, one_value_per_channel

MEMORY_ADVICE = ("lower train_micro_batch_size_per_gpu in the ds_config (\"auto\" with train_batch_size finds the "
                 "largest that fits), add \"activation_checkpointing\": {}, or take a config that holds less per "
                 "rank: python -m app.tools.plan shows which fits")
"""What to change when a run's step runs out of memory."""
PATIENCE_S = 30
"""How long a rank whose part failed waits for the others to say theirs (and ten times what that part took, where
the others do the same work: a trial step, a first compiled step)."""


def out_of_memory(error: BaseException) -> str:
    """What ran out, when error (or what it was raised from, or what a torch.compile backend failure wraps) is an
    out-of-memory error of the device or of the CPU allocator (which says it in a RuntimeError); else ''."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, torch.OutOfMemoryError):
            return (str(error).strip().splitlines() or ["out of memory"])[0][:200]
        if isinstance(error, RuntimeError) and "can't allocate memory" in str(error):
            said = (str(error).strip().splitlines() or [""])[0].split("DefaultCPUAllocator: ")[-1][:160]
            return said if "out of memory" in said.lower() else f"out of memory ({said})"
        error = error.__cause__ or error.__context__ or getattr(error, "inner_exception", None)
    return ""


def snapshot_words(shots: list) -> str:
    """The line's words on the memory snapshots written by the ranks that ran out of memory (app/observe/
    memory_snapshot.py), each [path, why it could not be written ('' when it was)]: '' when there are none."""
    shots = [s for s in shots if isinstance(s, list) and len(s) == 2 and all(isinstance(x, str) for x in s)]
    written, failed = [path for path, why in shots if not why], [(path, why) for path, why in shots if why]
    words = []
    if written:
        more = f" and {len(written) - 1} more beside it" if len(written) > 1 else ""
        words.append(f"memory snapshot: {written[0]}{more} (open it in https://pytorch.org/memory_viz)")
    if failed:
        more = f", nor {len(failed) - 1} more" if len(failed) > 1 else ""
        words.append(f"the memory snapshot could not be written to {failed[0][0]} ({failed[0][1]}){more}")
    return "; ".join(words)


class Board:
    """One run's agreements in the store: its rounds, a rank ending alone, the stop step. Its keys are its own
    (app/run<N>/, N the runs this rank has begun in this process group, counted in the store)."""

    def __init__(self):
        self.store = torch_private.default_store() if dist.many() else None
        self.rank, self.world = dist.rank(), dist.world_size()
        begun = self.store.add(f"app/runs/{self.rank}", 1) if self.store is not None else 0
        self.prefix, self.rounds, self.left, self.asked = f"app/run{begun}/", 0, False, False
        """left: this rank ended alone; asked: a stop was asked of it (a rank ending on a failure waits for nobody)."""
        self.stop_at = None
        """The step every rank stops at, once one asked."""

    def outcomes(self, mine, failed_after_s: float = None, patience_s: float = PATIENCE_S):
        """Every rank's outcome of this round (a tuple of JSON values), in rank order. failed_after_s: this rank's
        part failed that many seconds in; it then waits at most patience_s + 10x that (their part is the same work),
        and not once a stop is asked of it (its launcher ends every rank), and gets None when they have not all
        said theirs. A rank finding that another ended alone ends without a line (Ended)."""
        if self.store is None:
            return [mine]
        self.rounds += 1
        keys = [f"{self.prefix}round{self.rounds}/{r}" for r in range(self.world)]
        try:
            self.store.set(keys[self.rank], wire.encode(mine))
            if failed_after_s is None:
                self.store.wait(keys)  # as long as the group's timeout
            else:
                deadline = time.monotonic() + patience_s + 10 * failed_after_s
                while not self.store.check(keys):  # polled: a wait that times out has the store log warnings
                    self.ended_by_another()
                    if time.monotonic() > deadline or self.asked:
                        return None
                    time.sleep(0.05)
            said = [_outcome(self.store.get(key), key) for key in keys]
            self._read_by_all([f"{key}/read" for key in keys])
        except torch_dist.DistError:  # the store went with rank 0
            if failed_after_s is None:
                raise
            return None
        self.ended_by_another()
        return said

    def _read_by_all(self, keys: list, wait_s: float = 10):
        """Every rank marks the outcomes read; rank 0, whose process serves the store, then waits for all the marks
        (bounded), so that an outcome that ends the run does not take the store with it before a rank read it."""
        self.store.set(keys[self.rank], b"1")
        deadline = time.monotonic() + wait_s
        while self.rank == 0 and not self.store.check(keys) and not self.store.check([self.prefix + "alone"]) and \
                time.monotonic() < deadline:
            time.sleep(0.005)

    def alone(self, why: str) -> Ended:
        """The error that ends this rank alone, saying why; the others find it when their collectives fail."""
        if self.store is not None:
            with contextlib.suppress(torch_dist.DistError):
                self.store.set(self.prefix + "alone", wire.encode(why))
                self.left = True
            wire.keep_store()  # rank 0 serves it: up a while after this rank goes
        return Ended(why, alone=True)

    def ended_by_another(self):
        """Raise Ended (no line of its own) if another rank ended alone, having said why."""
        if self.store is None or self.left:
            return
        with contextlib.suppress(torch_dist.DistError):  # the store gone: nobody left a word
            if self.store.check([self.prefix + "alone"]):
                raise Ended(wire.decode(self.store.get(self.prefix + "alone"),
                                        f"the rendezvous store's key {self.prefix}alone", str))

    def stopping(self, asked: bool, step: int) -> bool:
        """At the boundary after step: whether every rank stops here. asked: a stop was asked of this rank, which
        posts the step they all stop at (two ahead; the first rank to post it sets it)."""
        if self.store is None:
            return asked
        if self.stop_at is None:
            key = self.prefix + "stop"
            if asked:
                self.store.compare_set(key, "", str(step + 2))
            if asked or self.store.check([key]):
                self.stop_at = int(self.store.get(key))
        return self.stop_at is not None and step >= self.stop_at



def agree_on_start(store, keys: list, rank: int, node: tuple, join_s: int):
    """Rank 0 decides whether every rank started and tells the others: a rank that did not, or that ended on a
    mistake before it could (launch.said_before_start), ends every rank, rank 0 saying why."""
    if rank == 0:
        verdict = _missing_ranks(store, keys, join_s)
        store.set("verdict", verdict)
        if verdict:
            raise UserError(verdict)
        return
    store.set_timeout(datetime.timedelta(seconds=2 * join_s))  # rank 0 may start later than we did
    try:
        verdict = bytes(store.get("verdict")).decode("utf-8", "replace")  # rank 0's line, or another's bytes
    except torch_dist.DistError:
        raise UserError(f"rank {rank} on {node[0]}: rank 0 did not finish the start-up within "
                        f"{2 * join_s} s") from None
    if verdict:
        raise Ended()  # rank 0 has said what is wrong; one line is enough


def _missing_ranks(store, keys: list, join_s: int) -> str:
    """'' once every rank has checked in, or the line that names the first that ended on a mistake before it could
    (launch.said_before_start), or who did not within join_s seconds."""
    deadline, said = time.monotonic() + join_s, [f"said/{r}" for r in range(len(keys))]
    while not store.check(keys) and time.monotonic() < deadline:
        failed = next((r for r, key in enumerate(said) if store.check([key])), None)
        if failed is not None:
            return f"rank {failed}: {wire.decode(store.get(said[failed]), f'the rendezvous store key {said[failed]}')}"
        time.sleep(0.1)
    missing = [r for r, key in enumerate(keys) if not store.check([key])]
    if not missing:
        return ""
    hosts = [host for host, slots in ds_internals.launcher_world_info().items() for _ in slots]
    down = sorted({hosts[r] for r in missing if r < len(hosts)})
    ranks = ",".join(map(str, missing))
    if down:
        return (f"{', '.join(down)} (rank {ranks}) did not start within {join_s} s: is it up and reachable by "
                f"ssh? `python -m app.tools.doctor --hostfile <hostfile>` checks every host")
    return (f"rank {ranks} did not start within {join_s} s: check that every node's launcher started "
            f"(for a hostfile, `python -m app.tools.doctor --hostfile <hostfile>` checks every host)")


def _outcome(raw: bytes, key: str) -> tuple:
    """A rank's outcome as posted: a JSON list, returned as a tuple."""
    said = wire.decode(raw, f"the rendezvous store's key {key}")
    return tuple(said) if isinstance(said, list) else said


@contextlib.contextmanager
def one_line(board: Board, engine=None, snapshot=None):
    """Around a run: an error that ends it on some ranks (a user's mistake, out of memory, a damaged file a loader
    found, a feature of the JSON DeepSpeed fails on) becomes one line, agreed by the ranks it ended together (rank
    0 says it), or said at once by a rank it ended alone while the others went on into a collective, where they
    wait for it; they end without a line. A failed collective whose cause no rank said stays itself (a crash).
    snapshot(): this rank's memory snapshot, written if its device ran out of memory (app/observe/
    memory_snapshot.py's Recorder.written), which the line names."""
    snapshot = snapshot or (lambda: None)
    try:
        yield
    except Ended as e:
        shot = snapshot() if e.alone else None  # this rank says its line: a snapshot it wrote belongs in it
        if shot:
            raise board.alone(f"{e}; {snapshot_words([shot])}") from None
        raise
    except Exception as e:  # noqa: BLE001 (sorted: the run's end in one line, or not the app's to say)
        said = out_of_memory(e)
        engine = engine() if callable(engine) else engine
        step = f"in training step {engine.global_steps + 1}" if engine is not None else "while starting"
        e = e if said else deepspeed_failure(e, step) or one_value_per_channel(e) or e
        if said or isinstance(e, UserError):
            raise _ended(board, engine, "memory" if said else "error", said or str(e), snapshot()) from None
        board.ended_by_another()
        raise


def _ended(board: Board, engine, kind: str, why: str, shot=None) -> Exception:
    """The error that ends the run from this rank: agreed with the ranks that failed too, which fail within a step
    of each other (only they post an outcome), or this rank's alone. shot: this rank's memory snapshot, if it
    wrote one; the line names every failed rank's."""
    outcomes = board.outcomes((kind, why, shot), 0.0)
    alone = outcomes is None
    kind, why = (kind, why) if alone else outcomes[0][:2]
    shots = snapshot_words([shot] if alone else [outcome[2] for outcome in outcomes if len(outcome) > 2])
    if kind == "error":
        said = f"{why}; {shots}" if shots else why
        return board.alone(said) if alone else UserError(said)
    steps = engine.global_steps if engine is not None else 0
    who = f"rank {board.rank}" if alone else "every rank" if len(outcomes) > 1 else "the run"
    where = " while the other ranks went on into that step's collectives" if alone else ""
    shots = f"; {shots}" if shots else ""
    said = f"{who} ran out of memory after {steps} step(s) ({why}){where}{shots}; {MEMORY_ADVICE}"
    return board.alone(said) if alone else UserError(said)
