"""Run time inside the process group: who this rank is, printing from rank 0, and the app's collectives, which
travel on the host group (gloo, CPU tensors) beside the device group, and the sum over a group of the device group's
ranks that passes each its gradient once, tested across real gloo ranks."""
import datetime
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest
import torch

from app.distributed import dist, endings, preemption, wire
from app.distributed import launch
from app.errors import Ended, UserError
from app.observe.metrics import Meter
from conftest import REPO, free_port, spawn_ranks


def _collectives(rank, world, tmp):
    launch.prepare_environment()
    info = launch.setup(timeout_s=60)
    assert (info.rank, info.world_size, info.backend, info.device.type) == (rank, world, "gloo", "cpu")
    assert dist.is_main() == (rank == 0)
    # the meter reduces sums and counts: rank r contributes (r + 1) samples of loss 10 * r each
    meter = Meter(["loss"], torch.device("cpu"))
    meter.add(torch.tensor(float(rank + 1)), loss=torch.tensor(10.0 * rank * (rank + 1)))
    result = meter.reduce()
    counts = [r + 1 for r in range(world)]
    assert result["count"] == sum(counts)
    assert result["loss"] == pytest.approx(sum(10 * r * c for r, c in enumerate(counts)) / sum(counts))
    assert meter.reduce()["count"] == 0, "reduce resets the window"
    assert dist.broadcast_object(f"from {rank}") == "from 0"
    assert dist.host_max([rank, -rank]) == [world - 1, 0]
    assert dist.host_sum([1, rank]) == [world, sum(range(world))]
    assert dist.gather_objects(["rank", rank]) == [["rank", r] for r in range(world)]
    _group_sum(rank, world)
    _group_gather(rank, world)
    _stop_step(rank, world)
    marker = tmp / "first"
    with dist.main_process_first():
        if rank == 0:
            time.sleep(0.5)
            marker.write_text("rank 0 was here")
        else:
            assert marker.read_text() == "rank 0 was here", "others wait for rank 0"
    _store_takes_no_pickle(rank, tmp)
    _outcomes(rank, world)
    dist.teardown()


def _group_sum(rank, world):
    """Every rank takes the same loss of the sum, and its part the loss's gradient once: the ranks' gradients then
    add up to the sum's (sequence parallelism's per-sequence sums: app/core/sequence_step.py)."""
    part = torch.tensor([1.0 + rank, 10.0 * (rank + 1)], requires_grad=True)
    whole = dist.group_sum(part, None)  # None: the default group, every rank
    (whole ** 2).sum().backward()
    expected = [sum(1.0 + r for r in range(world)), sum(10.0 * (r + 1) for r in range(world))]
    assert whole.tolist() == expected and part.grad.tolist() == [2 * e for e in expected]


def _group_gather(rank, world):
    """Each rank's rows, one shape on every rank, stacked in rank order on every rank (GRPO's completions sampled
    a share a rank of a sequence-parallel group)."""
    part = torch.tensor([[rank, 10 * rank], [rank + 100, 0]])
    whole = dist.group_gather(part, None)
    assert whole.tolist() == [row for r in range(world) for row in ([r, 10 * r], [r + 100, 0])]


# What a third process writes under a run's key of the store (the default group's prefixes, then the Board's): a
# pickle that would create a file when loaded, as anyone who can reach the store's port could write it.
CRAFTED = """import datetime, os, pickle, sys, torch.distributed as d
class Payload:
    def __reduce__(self):
        return (os.system, ("touch " + sys.argv[2],))
store = d.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=datetime.timedelta(seconds=30))
store.set("app/0//0//" + sys.argv[3], pickle.dumps(Payload()))
"""


def _store_takes_no_pickle(rank, tmp):
    """The store listens on MASTER_ADDR alone, not every interface; a crafted pickle written to it by a third
    process ends each rank in one line and runs nothing."""
    port, marker, board = int(os.environ["MASTER_PORT"]), tmp / "the-pickle-ran", endings.Board()
    if rank == 0:
        listening = {c.laddr.ip for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port}
        assert listening == {"127.0.0.1"}, listening
        subprocess.run([sys.executable, "-c", CRAFTED, str(port), str(marker), board.prefix + "alone"], check=True,
                       timeout=60)
    dist.barrier()
    with pytest.raises(UserError, match="holds a value this run's ranks did not write.*firewall"):
        board.outcomes(("", rank))
    with pytest.raises(UserError, match="firewall"):
        board.ended_by_another()
    assert not marker.exists(), "the pickle from the network ran"
    dist.barrier()


def _outcomes(rank, world):
    """Rounds through the store: gathered; a failed rank's wait bounded when the others are elsewhere (as if blocked
    in a collective it left); the others then end without a line, the rank that ended alone having said why."""
    board = endings.Board()
    assert board.outcomes(("", rank), None if rank else 0.0) == [("", r) for r in range(world)]
    if rank == world - 1:
        started = time.monotonic()
        assert board.outcomes(("memory", "out of memory"), 0.0, patience_s=0.5) is None
        assert 0.5 <= time.monotonic() - started < 5
        error = board.alone("rank left: why")
        assert isinstance(error, Ended) and error.alone and str(error) == "rank left: why"
        dist.barrier()
    else:
        dist.barrier()  # elsewhere until the last rank has left
        with pytest.raises(Ended, match="rank left: why") as ended:
            board.outcomes(("fatal", "Connection closed by peer"), 0.0)
        assert not ended.value.alone, "the rank that left said it"
    dist.barrier()


def _rank_0_ends_alone(rank, world):
    """Rank 0, which starts the store, ends alone while the others wait in a collective: their collective fails as
    it goes; they read why from the store, which outlives it, and end without a line of their own."""
    launch.prepare_environment()
    launch.setup(timeout_s=60)
    board = endings.Board()
    if rank == 0:
        board.alone("rank 0 ran out of memory")
        return  # its process ends, and the store with it
    with pytest.raises(Ended, match="rank 0 ran out of memory") as ended, endings.one_line(board):
        torch.distributed.all_reduce(torch.ones(1))  # rank 0 never joins it
    assert not ended.value.alone, "rank 0 said it"
    dist.teardown()


def test_rank_0_ending_alone_ends_the_others_without_a_line():
    spawn_ranks(3, _rank_0_ends_alone)


RANK_0 = """
import datetime, os, sys
from app.distributed import wire
if sys.argv[2] == "polled":
    del os.pidfd_open  # as on a system without pidfds (macOS)
wire.open_store("127.0.0.1", int(sys.argv[1]), 2, True, datetime.timedelta(seconds=30))
print(wire._store_process[0].pid, flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("watch", ["pidfd", "polled"])
def test_rank_0_store_runs_beside_it_not_under_it_and_ends_with_it(watch):
    """Not rank 0's child: DeepSpeed's launcher, ending a failed run, waits for rank 0's whole process tree, and a
    store orphaned by rank 0 lingers until the machine's init reaps it (seconds here; forever under a PID 1 that
    reaps nothing)."""
    rank_0 = subprocess.Popen([sys.executable, "-c", RANK_0, str(free_port()), watch], cwd=REPO, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    store = psutil.Process(int(rank_0.stdout.readline()))
    assert store.name() == wire.STORE_NAME and store.ppid() != rank_0.pid
    assert store not in psutil.Process(rank_0.pid).children(recursive=True)
    time.sleep(0.5)
    assert _running(store), "the store serves while rank 0 runs"
    rank_0.kill()
    rank_0.wait()
    deadline = time.monotonic() + 5
    while _running(store) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(store), "the store ends once rank 0 has"


def _running(process) -> bool:
    """Not ended (an ended process that init has not reaped yet is a zombie)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _stop_step(rank, world):
    """The last rank asks to stop after step 3: every rank stops at step 5, the same step."""
    board = endings.Board()
    said = []
    for step in range(1, 9):
        dist.barrier()  # the ranks' steps, each ending in a collective
        said.append(board.stopping(rank == world - 1 and step == 3, step))
    assert said == [False] * 4 + [True] * 4, said
    assert dist.gather_objects(said) == [said] * world


def _a_stop_ends_the_waits(rank, world):
    """A rank ending on a failure that its launcher then signals (as the deepspeed launcher SIGTERMs every rank when
    one dies) waits for nobody: it ends at once."""
    launch.prepare_environment()
    launch.setup(timeout_s=60)
    board = endings.Board()
    if rank == 1:
        stop = preemption.StopRequest(board, 60, watch_launcher=False)
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            started = time.monotonic()
            assert board.outcomes(("error", "why"), 0.0, patience_s=30) is None
            board.alone("why")
            assert time.monotonic() - started < 2
        finally:
            stop.close()
    dist.barrier()  # rank 0: elsewhere all along, as if blocked in a collective
    dist.teardown()


def test_a_rank_asked_to_stop_while_ending_on_a_failure_waits_for_nobody():
    spawn_ranks(2, _a_stop_ends_the_waits)


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_across_ranks(world, tmp_path):
    spawn_ranks(world, _collectives, tmp_path)


def _beside_a_device_only_group(rank, world, tmp):
    """What NCCL does to a CPU tensor, on a CPU: a default group registered for cuda alone refuses it. The app's
    bookkeeping (meters, stop requests, summaries, probes, checkpoint agreement) must never touch that group."""
    from app.distributed import preemption
    from app.observe import metrics, runlog, summary
    torch.distributed.init_process_group("cuda:gloo", rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=60))
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        torch.distributed.all_reduce(torch.ones(1))  # the device group: as on NCCL, a CPU tensor is refused
    dist.start_host_group(datetime.timedelta(seconds=60))
    dist.barrier()
    meter = Meter(["loss"], torch.device("cpu"))
    meter.add(torch.tensor(2.0), loss=torch.tensor(float(rank)))
    assert meter.reduce()["count"] == 2 * world
    stop = preemption.StopRequest(endings.Board(), 60, watch_launcher=False)
    assert [stop.agreed(1), stop.agreed(2)] == [False, False]
    stop.close()
    engine = SimpleNamespace(device=torch.device("cpu"), zero_optimization_stage=lambda: 2,
                             pipeline_parallelism=False, num_stages=1, autotp_size=lambda: 1,
                             torch_autocast_enabled=lambda: False, bfloat16_enabled=lambda: False,
                             fp16_enabled=lambda: False)
    task = SimpleNamespace(tokens_per_sample=16, name="causal_lm", per_sample=dict, summary_metrics=("eval_loss",))
    settings = SimpleNamespace(peak_flops=0.0, model="m", dataset="d", deepspeed_config="c.json")
    throughput = metrics.throughput_for(task.tokens_per_sample, 1e9, engine.device, torch.float32, settings.peak_flops)
    assert throughput.peak_flops > 0
    world_info = SimpleNamespace(world_size=world, launcher="deepspeed", device=torch.device("cpu"))
    log = runlog.RunLog(tmp / "run" if rank == 0 else None, 1)
    result = {"steps": 1, "stopped_early": False, "eval_loss": 1.0}
    assert summary.summarise(result, settings, world_info, engine, task, log, None, time.perf_counter()) == 0
    assert dist.broadcast_object(rank) == 0 and dist.gather_objects(rank) == list(range(world))
    dist.teardown()


def test_bookkeeping_never_uses_the_device_group(tmp_path):
    """Every collective the app makes outside the engine works beside a device group that takes no CPU
    tensor (as NCCL takes none): run on 2 or more GPUs, they would otherwise crash."""
    spawn_ranks(2, _beside_a_device_only_group, tmp_path)
    summary = (tmp_path / "run" / "summary.json").read_text()
    assert '"world_size": 2' in summary and '"peak_memory_bytes"' in summary
