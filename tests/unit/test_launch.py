"""Launch time: launcher detection, each launcher's variables, node names, the no-launcher plan, the device
DeepSpeed is made to take."""
import pytest

from app.distributed import launch
from app.errors import UserError


@pytest.mark.parametrize("env, expected", [
    ({}, "none"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "x"}, "torchrun"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_SIZE": "2", "CROSS_RANK": "0"}, "deepspeed"),
    ({"RANK": "0", "WORLD_SIZE": "1"}, "env"),
])
def test_detect_launcher(env, expected):
    assert launch.detect_launcher(env) == expected


@pytest.mark.parametrize("gpus, single, mode", [(0, False, "cpu"), (1, False, "gpu"), (4, True, "gpu"),
                                               (4, False, "relaunch")])
def test_plan_without_launcher(gpus, single, mode):
    chosen, reason = launch.plan_without_launcher(gpus, single)
    assert chosen == mode and reason.startswith("no launcher")


@pytest.mark.parametrize("env, expected", [
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, "mpirun"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}, "srun"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7"}, "none"),  # the batch script, not a task
    ({"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"},
     "torchrun"),  # torchrun started by srun: its workers are torchrun's
])
def test_detect_mpirun_and_srun(env, expected):
    assert launch.detect_launcher(env) == expected


def test_mpirun_variables_become_the_standard_ones():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "10.0.0.1"}
    assert launch.launcher_env("mpirun", env) == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500"}
    assert launch.node_of("mpirun", env)[1] == "2", "ranks 2 and 3 share a node"


@pytest.mark.parametrize("env", [
    {"MV2_COMM_WORLD_RANK": "3", "MV2_COMM_WORLD_SIZE": "4", "MV2_COMM_WORLD_LOCAL_RANK": "1",
     "MV2_COMM_WORLD_LOCAL_SIZE": "2"},  # deepspeed --launcher mvapich: MVAPICH2's mpirun
    {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},  # MPICH's or Intel MPI's
])
def test_every_mpis_variables_become_the_standard_ones(env):
    """Read as none, each rank trained alone as rank 0 of 1 (or relaunched itself on every GPU of its node)."""
    assert launch.detect_launcher(env) == "mpirun"
    assert launch.launcher_env("mpirun", {**env, "MASTER_ADDR": "n0"}) == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_SIZE": "2", "MASTER_ADDR": "n0",
        "MASTER_PORT": "29500"}
    assert launch.node_of("mpirun", env)[1] == "2"
    with pytest.raises(UserError, match="-genv MASTER_ADDR"):
        launch.launcher_env("mpirun", env)


def test_a_shell_srun_opened_on_the_allocation_is_no_launcher():
    """srun --pty bash: its one task is the shell; a run started in it decides as without a launcher (every
    allocated GPU), not as one task of one rank."""
    shell = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_ID": "0", "SLURM_PTY_PORT": "40231"}
    assert launch.detect_launcher(shell) == "none"
    inner = {**shell, "SLURM_NTASKS": "4", "SLURM_STEP_ID": "1"}  # srun -n 4 typed in that shell: its tasks
    assert launch.detect_launcher(inner) == "srun"


def test_a_relaunch_runs_a_module_as_a_module(monkeypatch):
    """python -m app.tools.commcheck on several GPUs: each rank runs the module, whose imports need the
    repository on the path, not the file as a script."""
    import sys
    from types import SimpleNamespace

    class Replaced(Exception):
        pass

    def execv(path, argv):
        raise Replaced(argv)
    monkeypatch.setattr(launch.os, "execv", execv)
    monkeypatch.setattr(sys, "argv", ["/repo/app/tools/commcheck.py", "--rounds", "2"])
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", SimpleNamespace(name="app.tools.commcheck"))
    with pytest.raises(Replaced) as module:
        launch._relaunch()
    assert module.value.args[0][-4:] == ["--module", "app.tools.commcheck", "--rounds", "2"]
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", None)  # python app/train.py
    monkeypatch.setattr(sys, "argv", ["app/train.py", "--epochs", "1"])
    with pytest.raises(Replaced) as script:
        launch._relaunch()
    assert script.value.args[0][-3:] == ["app/train.py", "--epochs", "1"]


def test_rank_and_world_size_without_master_addr_is_one_line(monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "LOCAL_SIZE", "CROSS_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(UserError, match="RANK and WORLD_SIZE are set \\(the env launcher\\) but MASTER_ADDR is not"):
        launch.setup()


def test_mpirun_without_master_addr_says_how_to_pass_it():
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
    with pytest.raises(UserError, match="MASTER_ADDR.*deepspeed_env"):
        launch.launcher_env("mpirun", env)


def test_srun_variables_become_the_standard_ones():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
           "SLURM_STEP_NODELIST": "gpu[07-08,11]", "SLURM_STEP_TASKS_PER_NODE": "2(x2),2", "SLURM_JOB_ID": "1234",
           "SLURMD_NODENAME": "gpu11"}
    assert launch.launcher_env("srun", env) == {
        "RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "1", "LOCAL_SIZE": "2", "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(20000 + 1234)}
    assert launch.node_of("srun", env) == ("gpu11", "2")
    assert launch.launcher_env("srun", {**env, "MASTER_ADDR": "head", "MASTER_PORT": "5"})["MASTER_ADDR"] == "head"


@pytest.mark.parametrize("nodelist, first", [("node1", "node1"), ("gpu[07-09,12]", "gpu07"), ("a,b[1-2]", "a"),
                                             ("n[3,5]", "n3"), ("rack1-n[010-011],x", "rack1-n010")])
def test_first_host_of_a_slurm_node_list(nodelist, first):
    assert launch.first_host(nodelist) == first


@pytest.mark.parametrize("spec, node, count", [("2", 0, 2), ("2(x3),1", 2, 2), ("2(x3),1", 3, 1), ("4,1(x2)", 2, 1)])
def test_tasks_on_node(spec, node, count):
    assert launch.tasks_on_node(spec, node) == count


def test_deepspeed_node_is_named_as_in_the_hostfile():
    world_info = {"10.0.0.1": [0, 1], "10.0.0.2": [0, 1]}
    env = {"RANK": "3", "WORLD_SIZE": "4", "CROSS_RANK": "1", "LOCAL_SIZE": "2"}
    assert launch.node_of("deepspeed", env, world_info) == ("10.0.0.2", "1")


def test_describe_nodes():
    assert launch.describe_nodes([("a", "0"), ("a", "0"), ("b", "1"), ("b", "1")]) == \
        "2 node(s): a (ranks 0-1), b (ranks 2-3)"
    # loopback "nodes" of one machine share its name: the launcher's node key tells them apart
    assert launch.describe_nodes([("vm", "0"), ("vm", "1")]) == "2 node(s): vm#0 (rank 0), vm#1 (rank 1)"
    assert launch.describe_nodes([("a", "0"), ("b", "1"), ("a", "0")]) == \
        "2 node(s): a (ranks 0,2), b (rank 1)"


def test_rank_env_is_what_a_launcher_gives_a_rank_of_one_machine():
    env = launch.rank_env(1, 3, 12345)
    assert env == {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "LOCAL_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": "12345"}
    assert launch.detect_launcher(env) == "deepspeed", "ranks started with it look like the deepspeed launcher's"


@pytest.mark.parametrize("local_rank, visible, index", [(0, 8, 0), (3, 8, 3), (3, 1, 0), (1, 1, 0), (2, 2, -1)])
def test_each_local_rank_takes_its_gpu_or_the_one_it_was_bound_to(local_rank, visible, index):
    """srun --gpus-per-task=1 shows each task one GPU: local rank 3 takes it, not a missing cuda:3."""
    assert launch.gpu_index(local_rank, visible) == index
