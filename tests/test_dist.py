"""Run time inside the process group: who this rank is, printing from rank 0, collectives across real gloo ranks."""
import time

import pytest
import torch

from app import dist, launch
from app.metrics import Meter
from conftest import spawn_ranks


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
    assert dist.all_reduce_max(torch.tensor([rank])).item() == world - 1
    marker = tmp / "first"
    with dist.main_process_first():
        if rank == 0:
            time.sleep(0.5)
            marker.write_text("rank 0 was here")
        else:
            assert marker.read_text() == "rank 0 was here", "others wait for rank 0"
    dist.teardown()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_collectives_across_ranks(world, tmp_path):
    spawn_ranks(world, _collectives, tmp_path)


def test_before_the_group_exists_the_launcher_variables_say_who_we_are(monkeypatch):
    assert not torch.distributed.is_initialized()
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert (dist.rank(), dist.world_size(), dist.is_main()) == (2, 4, False)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert (dist.rank(), dist.world_size(), dist.is_main()) == (0, 1, True)


def test_print0_speaks_on_the_main_rank_only(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    dist.print0("from rank 1")
    monkeypatch.setenv("RANK", "0")
    dist.print0("from rank 0")
    assert capsys.readouterr().out == "from rank 0\n"


def test_without_a_group_the_collectives_leave_values_as_they_are():
    assert not torch.distributed.is_initialized()
    values = torch.tensor([1.0, 5.0])
    assert dist.all_reduce_sum(values) is values and values.tolist() == [1.0, 5.0]
    assert dist.all_reduce_max(values) is values and values.tolist() == [1.0, 5.0]
    sent = {"a": [1, 2]}
    assert dist.broadcast_object(sent) is sent
    dist.barrier()
    ran = []
    with dist.main_process_first():
        ran.append(True)
    assert ran == [True]
    dist.teardown()  # safe when no group exists
