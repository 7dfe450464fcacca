"""Launcher detection, the no-launcher plan, and collectives across real gloo ranks."""
import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from app import distributed
from app.errors import UserError
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


@pytest.mark.parametrize("env, expected", [
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, "mpirun"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}, "srun"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7"}, "none"),  # the batch script, not a task
    ({"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"},
     "torchrun"),  # torchrun started by srun: its workers are torchrun's
])
def test_detect_mpirun_and_srun(env, expected):
    assert distributed.detect_launcher(env) == expected


def test_mpirun_variables_become_the_standard_ones():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "10.0.0.1"}
    assert distributed.launcher_env("mpirun", env) == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500"}
    assert distributed.node_of("mpirun", env)[1] == "2", "ranks 2 and 3 share a node"


def test_mpirun_without_master_addr_says_how_to_pass_it():
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
    with pytest.raises(UserError, match="MASTER_ADDR.*deepspeed_env"):
        distributed.launcher_env("mpirun", env)


def test_srun_variables_become_the_standard_ones():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
           "SLURM_STEP_NODELIST": "gpu[07-08,11]", "SLURM_STEP_TASKS_PER_NODE": "2(x2),2", "SLURM_JOB_ID": "1234",
           "SLURMD_NODENAME": "gpu11"}
    assert distributed.launcher_env("srun", env) == {
        "RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "1", "LOCAL_SIZE": "2", "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(20000 + 1234)}
    assert distributed.node_of("srun", env) == ("gpu11", "2")
    assert distributed.launcher_env("srun", {**env, "MASTER_ADDR": "head", "MASTER_PORT": "5"})["MASTER_ADDR"] == "head"


@pytest.mark.parametrize("nodelist, first", [("node1", "node1"), ("gpu[07-09,12]", "gpu07"), ("a,b[1-2]", "a"),
                                             ("n[3,5]", "n3"), ("rack1-n[010-011],x", "rack1-n010")])
def test_first_host_of_a_slurm_node_list(nodelist, first):
    assert distributed.first_host(nodelist) == first


@pytest.mark.parametrize("spec, node, count", [("2", 0, 2), ("2(x3),1", 2, 2), ("2(x3),1", 3, 1), ("4,1(x2)", 2, 1)])
def test_tasks_on_node(spec, node, count):
    assert distributed.tasks_on_node(spec, node) == count


def test_deepspeed_node_is_named_as_in_the_hostfile():
    world_info = {"10.0.0.1": [0, 1], "10.0.0.2": [0, 1]}
    env = {"RANK": "3", "WORLD_SIZE": "4", "CROSS_RANK": "1", "LOCAL_SIZE": "2"}
    assert distributed.node_of("deepspeed", env, world_info) == ("10.0.0.2", "1")


def test_describe_nodes():
    assert distributed.describe_nodes([("a", "0"), ("a", "0"), ("b", "1"), ("b", "1")]) == \
        "2 node(s): a (ranks 0-1), b (ranks 2-3)"
    # loopback "nodes" of one machine share its name: the launcher's node key tells them apart
    assert distributed.describe_nodes([("vm", "0"), ("vm", "1")]) == "2 node(s): vm#0 (rank 0), vm#1 (rank 1)"
    assert distributed.describe_nodes([("a", "0"), ("b", "1"), ("a", "0")]) == \
        "2 node(s): a (ranks 0,2), b (rank 1)"
