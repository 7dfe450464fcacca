"""How a run ends: out of memory found, errors made one line, the ranks' agreements on an in-process store."""
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as torch_dist

from app.distributed import endings, wire
from app.errors import Ended, UserError

CPU_OOM = "out of memory (can't allocate memory: you tried to allocate 4611686018427387904 bytes"


def _board(store, rank: int, world: int = 2) -> endings.Board:
    """A Board on store as rank `rank` of `world` sees it."""
    board = endings.Board()
    board.store, board.rank, board.world = store, rank, world
    return board


def _raise(error: BaseException):
    raise error


def _cpu_oom():
    torch.empty(2**62, dtype=torch.uint8)


def _in_deepspeed():
    """Raise from a frame whose file is DeepSpeed's, as a section of the JSON this machine does not suit does."""
    scope = {}
    exec(compile("def step():\n    raise RuntimeError('start (114) + length (1843) exceeds dimension size (114).')",
                 "/venv/site-packages/deepspeed/runtime/zenflow/engine.py", "exec"), scope)
    scope["step"]()


def _line(caught) -> str:
    message = str(caught.value)
    assert message and "\n" not in message, message
    return message


def test_the_cpu_allocators_failure_is_out_of_memory():
    with pytest.raises(RuntimeError) as caught:
        _cpu_oom()
    said = endings.out_of_memory(caught.value)
    assert said.startswith(CPU_OOM) and len(said) <= len("out of memory ()") + 160, said


def test_a_devices_out_of_memory_is_its_first_line_and_is_found_through_what_wraps_it():
    device = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                                    "of 79.1 GiB\nIf reserved but unallocated memory is large try setting ...")
    assert endings.out_of_memory(device) == "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total " \
                                            "capacity of 79.1 GiB"
    assert endings.out_of_memory(torch.OutOfMemoryError("")) == "out of memory"
    assert len(endings.out_of_memory(torch.OutOfMemoryError("x" * 500))) == 200
    try:
        try:
            raise device
        except torch.OutOfMemoryError as e:
            raise RuntimeError("the step failed") from e
    except RuntimeError as wrapped:
        assert endings.out_of_memory(wrapped).startswith("CUDA out of memory.")
    assert endings.out_of_memory(ValueError("labels out of range")) == ""
    assert endings.out_of_memory(RuntimeError("Connection closed by peer")) == ""


def test_a_run_of_one_rank_agrees_with_itself_and_waits_for_nobody():
    board = endings.Board()
    assert board.store is None
    assert board.outcomes(("memory", "why"), 0.0) == [("memory", "why")]
    assert board.stopping(False, 3) is False and board.stopping(True, 4) is True
    board.ended_by_another()
    ended = board.alone("rank 0 ran out of memory")
    assert isinstance(ended, Ended) and ended.alone and str(ended) == "rank 0 ran out of memory"


@pytest.mark.parametrize("steps, where", [(None, "while starting"), (7, "in training step 8")])
def test_an_error_in_deepspeeds_code_becomes_one_line_saying_when(steps, where):
    engine = None if steps is None else SimpleNamespace(global_steps=steps)
    with pytest.raises(UserError) as caught, endings.one_line(endings.Board(), lambda: engine):
        _in_deepspeed()
    assert _line(caught).startswith(f"DeepSpeed failed {where} (RuntimeError: start (114)")


@pytest.mark.parametrize("steps, after", [(None, 0), (3, 3)])
def test_running_out_of_memory_alone_says_after_how_many_steps_and_what_to_change(steps, after):
    engine = None if steps is None else SimpleNamespace(global_steps=steps)
    with pytest.raises(UserError) as caught, endings.one_line(endings.Board(), engine):
        _cpu_oom()
    line = _line(caught)
    assert line.startswith(f"the run ran out of memory after {after} step(s) ({CPU_OOM}"), line
    assert line.endswith(f"; {endings.MEMORY_ADVICE}")
    assert caught.value.__suppress_context__, "no traceback of the allocator"


def test_an_out_of_memory_that_torch_compile_wrapped_is_found():
    """torch.compile's backend failure holds the error it wraps, raised from None."""
    from torch._dynamo.exc import BackendCompilerFailed
    wrapped = BackendCompilerFailed(lambda: None, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate "
                                                                         "1.00 GiB\nmore"), None)
    assert wrapped.__cause__ is None and wrapped.__context__ is None
    assert endings.out_of_memory(wrapped) == "CUDA out of memory. Tried to allocate 1.00 GiB"


WRITTEN = ["runs/x/memory/rank0.oom.pickle", ""]
VIEWER = "(open it in https://pytorch.org/memory_viz)"


def test_running_out_of_memory_names_the_snapshot_this_rank_wrote_before_the_advice(tmp_path):
    from app.observe import memory_snapshot
    path = memory_snapshot.snapshot_path(tmp_path, 0)
    with pytest.raises(UserError) as caught, endings.one_line(endings.Board(), SimpleNamespace(global_steps=3),
                                                              lambda: memory_snapshot.write(path)):
        _cpu_oom()
    line = _line(caught)
    assert line.startswith(f"the run ran out of memory after 3 step(s) ({CPU_OOM}"), line
    assert line.endswith(f"); memory snapshot: {path} {VIEWER}; {endings.MEMORY_ADVICE}"), line
    assert path.is_file()


def test_a_snapshot_that_could_not_be_written_still_says_out_of_memory_and_why_not_and_none_says_nothing():
    with pytest.raises(UserError) as caught, endings.one_line(endings.Board(), None,
                                                              lambda: ["/dev/full", "No space left on device"]):
        _cpu_oom()
    line = _line(caught)
    assert line.startswith(f"the run ran out of memory after 0 step(s) ({CPU_OOM}"), line
    assert "); the memory snapshot could not be written to /dev/full (No space left on device); lower " in line
    assert "memory_viz" not in line
    with pytest.raises(UserError) as caught, endings.one_line(endings.Board(), None, lambda: None):
        _cpu_oom()
    assert "snapshot" not in _line(caught)


def test_an_out_of_memory_another_error_carries_gets_its_snapshot_named_after_the_line():
    """The first compiled step's out-of-memory is agreed by the ranks and ends as a user error naming it."""
    said = "the first training step failed on rank 0: out of memory (OutOfMemoryError: CUDA out of memory.)"
    with pytest.raises(UserError) as caught, endings.one_line(endings.Board(), None, lambda: WRITTEN):
        _raise(UserError(said))
    assert _line(caught) == f"{said}; memory snapshot: {WRITTEN[0]} {VIEWER}"
    with pytest.raises(Ended) as caught, endings.one_line(endings.Board(), None, lambda: WRITTEN):
        _raise(Ended(said + "; the other ranks went on into that step's collectives", alone=True))
    assert caught.value.alone and _line(caught).endswith(f"collectives; memory snapshot: {WRITTEN[0]} {VIEWER}")


def test_no_snapshot_is_asked_for_where_another_rank_says_the_line_or_a_bug_stays_a_crash():
    asked = []
    for error in (Ended("rank 1 said it"), KeyError("input_ids")):
        with pytest.raises(type(error)), endings.one_line(endings.Board(), None, lambda: asked.append(1)):
            _raise(error)
    assert asked == []


def test_ranks_that_ran_out_together_name_every_snapshot_written_and_those_that_could_not_be():
    store = torch_dist.HashStore()
    store.set("app/run0/round1/0", wire.encode(["memory", "CUDA out of memory.", WRITTEN]))
    store.set("app/run0/round1/2", wire.encode(["memory", "CUDA out of memory.", None]))
    for rank in (3, 4):
        shot = [f"r/memory/rank{rank}.oom.pickle", "Read-only file system"]
        store.set(f"app/run0/round1/{rank}", wire.encode(["memory", "CUDA out of memory.", shot]))
    with pytest.raises(UserError) as caught, endings.one_line(_board(store, rank=1, world=5),
                                                              SimpleNamespace(global_steps=5),
                                                              lambda: ["runs/x/memory/rank1.oom.pickle", ""]):
        _cpu_oom()
    assert _line(caught) == (f"every rank ran out of memory after 5 step(s) (CUDA out of memory.); memory snapshot: "
                             f"{WRITTEN[0]} and 1 more beside it {VIEWER}; the memory snapshot could not be written "
                             f"to r/memory/rank3.oom.pickle (Read-only file system), nor 1 more; "
                             f"{endings.MEMORY_ADVICE}")


def test_a_rank_that_ran_out_alone_names_its_own_snapshot_in_its_line():
    store = torch_dist.HashStore()
    board = _board(store, rank=1)
    board.asked = True  # its launcher is ending every rank: it waits for nobody
    mine = ["runs/x/memory/rank1.oom.pickle", ""]
    with pytest.raises(Ended) as caught, endings.one_line(board, SimpleNamespace(global_steps=2), lambda: mine):
        _cpu_oom()
    line = _line(caught)
    assert f"while the other ranks went on into that step's collectives; memory snapshot: {mine[0]} {VIEWER}; " \
           f"{endings.MEMORY_ADVICE}" in line, line
    assert wire.decode(store.get("app/run0/alone"), "x") == line


def test_a_users_mistake_passes_as_itself_and_a_bug_stays_a_crash():
    with pytest.raises(UserError, match="^--lr must be positive$"), endings.one_line(endings.Board()):
        _raise(UserError("--lr must be positive"))
    ended = Ended("rank 1 said it")
    with pytest.raises(Ended) as caught, endings.one_line(endings.Board()):
        _raise(ended)
    assert caught.value is ended
    with pytest.raises(KeyError, match="input_ids"), endings.one_line(endings.Board()):
        _raise(KeyError("input_ids"))


def test_a_round_gathers_every_ranks_outcome_in_rank_order_and_marks_them_read():
    store = torch_dist.HashStore()
    board = _board(store, rank=1)
    store.set("app/run0/round1/0", wire.encode(["", ""]))
    assert board.outcomes(("", "")) == [("", ""), ("", "")]
    assert store.check(["app/run0/round1/1/read"]), "rank 0 keeps the store up until every rank has read it"
    store.set("app/run0/round2/0", wire.encode(["compile", "rank 0's graph"]))
    assert board.outcomes(("fatal", "mine"), 0.0) == [("compile", "rank 0's graph"), ("fatal", "mine")]


def test_a_rank_whose_part_failed_waits_a_bounded_time_for_the_others():
    board = _board(torch_dist.HashStore(), rank=1)
    started = time.monotonic()
    assert board.outcomes(("memory", "why"), failed_after_s=0.03, patience_s=0.2) is None
    assert 0.5 <= time.monotonic() - started < 3, "patience plus ten times what its part took"
    board.asked = True
    started = time.monotonic()
    assert board.outcomes(("memory", "why"), failed_after_s=0.0, patience_s=30) is None
    assert time.monotonic() - started < 1, "a rank asked to stop waits for nobody"


def test_a_rank_waiting_for_the_others_ends_without_a_line_when_one_ended_alone():
    store = torch_dist.HashStore()
    _board(store, rank=0).alone("rank 0 ran out of memory after 3 step(s)")
    with pytest.raises(Ended, match="^rank 0 ran out of memory after 3 step\\(s\\)$") as caught:
        _board(store, rank=1).outcomes(("fatal", "Connection closed by peer"), 0.0, patience_s=30)
    assert not caught.value.alone, "rank 0 said it"


def test_a_reason_that_is_not_a_string_was_not_written_by_the_run():
    store = torch_dist.HashStore()
    store.set("app/run0/alone", wire.encode(["not", "a", "reason"]))
    with pytest.raises(UserError, match="key app/run0/alone holds a value this run's ranks did not write \\(not "
                                        "JSON of what they write.*firewall"):
        _board(store, rank=1).ended_by_another()


def test_a_verdict_of_bytes_no_rank_wrote_ends_the_rank_without_a_traceback():
    """The store has no authentication: something else on the network may write the start's verdict."""
    store = torch_dist.HashStore()
    store.set("verdict", b"\xff\xfe not text")
    with pytest.raises(Ended):
        endings.agree_on_start(store, ["node/0", "node/1"], 1, ("node-b", 0), join_s=1)


def test_ranks_that_ran_out_of_memory_together_say_rank_0s_words():
    store = torch_dist.HashStore()
    store.set("app/run0/round1/0", wire.encode(["memory", "CUDA out of memory. Tried to allocate 2.00 GiB"]))
    with pytest.raises(UserError) as caught, endings.one_line(_board(store, rank=1), SimpleNamespace(global_steps=5)):
        _cpu_oom()
    assert _line(caught).startswith("every rank ran out of memory after 5 step(s) (CUDA out of memory. Tried to "
                                    "allocate 2.00 GiB); lower train_micro_batch_size_per_gpu")


def test_a_rank_ending_alone_says_its_own_line_and_leaves_why_for_the_others():
    store = torch_dist.HashStore()
    board = _board(store, rank=1)
    board.asked = True  # its launcher is ending every rank: it waits for nobody
    with pytest.raises(Ended) as caught, endings.one_line(board, SimpleNamespace(global_steps=2)):
        _cpu_oom()
    assert caught.value.alone and board.left
    line = _line(caught)
    assert line.startswith(f"rank 1 ran out of memory after 2 step(s) ({CPU_OOM}") and \
        "while the other ranks went on into that step's collectives; lower" in line, line
    assert wire.decode(store.get("app/run0/alone"), "x") == line
    board.ended_by_another()  # its own word does not end it a second time


def test_the_first_rank_asked_to_stop_sets_the_step_every_rank_stops_at():
    store = torch_dist.HashStore()
    first, second = _board(store, rank=1), _board(store, rank=0)
    assert [first.stopping(step == 3, step) for step in (1, 2, 3)] == [False, False, False]
    assert [second.stopping(step == 4, step) for step in (3, 4, 5, 6)] == [False, False, True, True]
    assert (first.stop_at, second.stop_at) == (5, 5), "two steps after the first ask, whoever asks later"


def test_rank_0_starts_the_run_once_every_rank_checked_in():
    store = torch_dist.HashStore()
    keys = ["node/0", "node/1"]
    for key in keys:
        store.set(key, "[]")
    endings.agree_on_start(store, keys, 0, ("node-a", 0), join_s=5)
    assert store.get("verdict") == b""
    endings.agree_on_start(store, keys, 1, ("node-b", 0), join_s=5)


def test_rank_0_says_the_mistake_that_ended_a_rank_before_it_started_and_the_others_end_without_a_line():
    store = torch_dist.HashStore()
    keys = ["node/0", "node/1", "node/2"]
    store.set("node/0", "[]")
    store.set("said/2", wire.encode("--deepspeed_config: no such file: ds.json"))
    with pytest.raises(UserError, match="^rank 2: --deepspeed_config: no such file: ds.json$"):
        endings.agree_on_start(store, keys, 0, ("node-a", 0), join_s=30)
    with pytest.raises(Ended) as caught:
        endings.agree_on_start(store, keys, 1, ("node-b", 0), join_s=30)
    assert str(caught.value) == "" and not caught.value.alone


def test_rank_0_names_the_ranks_that_did_not_start_in_time():
    store = torch_dist.HashStore()
    keys = [f"node/{r}" for r in range(4)]
    store.set("node/0", "[]")
    store.set("node/2", "[]")
    started = time.monotonic()
    with pytest.raises(UserError) as caught:
        endings.agree_on_start(store, keys, 0, ("node-a", 0), join_s=0.3)
    assert 0.3 <= time.monotonic() - started < 3
    assert _line(caught).startswith("rank 1,3 did not start within 0.3 s: check that every node's launcher started")
    assert "python -m app.tools.doctor --hostfile <hostfile>" in str(caught.value)


def test_a_rank_whose_rank_0_never_decides_ends_in_one_line_naming_itself():
    with pytest.raises(UserError, match="^rank 3 on node-b: rank 0 did not finish the start-up within 0.4 s$"):
        endings.agree_on_start(torch_dist.HashStore(), ["node/0"], 3, ("node-b", 1), join_s=0.2)
