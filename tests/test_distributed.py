"""Launcher detection, the no-launcher plan, and collectives across real gloo ranks."""
import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from app import distributed
from app.metrics import Meter
from conftest import free_port


@pytest.mark.parametrize("env, expected", [
    ({}, "none"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "x"}, "torchrun"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_SIZE": "2", "CROSS_RANK": "0"}, "deepspeed"),
    ({"RANK": "0", "WORLD_SIZE": "1"}, "env"),
])
def test_detect_launcher(env, expected):
    assert distributed.detect_launcher(env) == expected


@pytest.mark.parametrize("gpus, single, mode", [(0, False, "cpu"), (1, False, "gpu"), (4, True, "gpu"),
                                               (4, False, "relaunch")])
def test_plan_without_launcher(gpus, single, mode):
    chosen, reason = distributed.plan_without_launcher(gpus, single)
    assert chosen == mode and reason.startswith("no launcher")


def _rank_main(rank, world, port, tmp):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    distributed.prepare_environment()
    info = distributed.setup(timeout_s=60)
    assert (info.rank, info.world_size, info.backend, info.device.type) == (rank, world, "gloo", "cpu")
    assert distributed.is_main() == (rank == 0)
    # the meter reduces sums and counts: rank r contributes (r + 1) samples of loss 10 * r each
    meter = Meter(["loss"], torch.device("cpu"))
    meter.add(torch.tensor(float(rank + 1)), loss=torch.tensor(10.0 * rank * (rank + 1)))
    result = meter.reduce()
    counts = [r + 1 for r in range(world)]
    assert result["count"] == sum(counts)
    assert result["loss"] == pytest.approx(sum(10 * r * c for r, c in enumerate(counts)) / sum(counts))
    assert meter.reduce()["count"] == 0, "reduce resets the window"
    assert distributed.broadcast_object(f"from {rank}") == "from 0"
    assert distributed.all_reduce_max(torch.tensor([rank])).item() == world - 1
    marker = tmp / "first"
    with distributed.main_process_first():
        if rank == 0:
            time.sleep(0.5)
            marker.write_text("rank 0 was here")
        else:
            assert marker.read_text() == "rank 0 was here", "others wait for rank 0"
    distributed.teardown()


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_across_ranks(world, tmp_path):
    mp.start_processes(_rank_main, args=(world, free_port(), tmp_path), nprocs=world, join=True, start_method="spawn")
