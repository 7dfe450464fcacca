"""Multi-node launches for real, on loopback "hosts" of this machine: pdsh over ssh, one launcher per
node, mpirun, Slurm and torchrun, each computing what one 2-rank run on one node computes."""
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from helpers.cluster import DOWN_HOST, HOSTS, TWO_HOSTS, cluster  # noqa: F401 (a fixture)
from conftest import (BIN, REPO, assert_one_error_line, free_port, launch_script, log_launch, read_metrics,
                      read_summary, run, told)


ARGS = ["--max_steps", "4", "--log_interval", "1"]
SHM = Path("/dev/shm")


def shm_segments() -> set:
    return set(SHM.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*"))


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """metrics.csv rows of the same run on one node: 2 ranks as the deepspeed launcher starts them (its start is
    not what this run is for: conftest.launch_script)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    result = launch_script(2, "app/train.py", *ARGS, "--output_dir", out)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return read_metrics(out)


def check_run(out, stdout, reference, launcher, nodes, shm_before):
    """The run equals the one-node reference, rank 0 alone reported, and its mode line lists the nodes."""
    train_rows, eval_rows = read_metrics(out)
    want_train, want_eval = reference
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4]
    assert [r["loss"] for r in train_rows] == pytest.approx([r["loss"] for r in want_train], abs=1e-6)
    assert eval_rows[-1]["eval_loss"] == pytest.approx(want_eval[-1]["eval_loss"], abs=1e-6)
    summary = read_summary(out)
    assert summary["world_size"] == 2 and summary["launcher"] == launcher
    mode = [line for line in stdout.splitlines() if "mode: started by" in line]
    assert len(mode) == 1, stdout[-3000:]
    assert f"mode: started by {launcher}; 2 rank(s) on {nodes}; gloo on cpu" in mode[0]
    # no rank left a shared-memory segment behind (on several "nodes" of one machine none is made)
    assert shm_segments() <= shm_before


def launch(cmd, env, timeout=300):
    result = run(cmd, timeout=timeout, **env)
    assert result.returncode == 0, told(result)
    return result.stdout + result.stderr


def launch_per_node(cmds, env, timeout=300):
    """Start one command per "node" at once (as on separate machines) and wait for all of them."""
    full_env, started = {**os.environ, "PYTHONUNBUFFERED": "1", **env}, time.perf_counter()
    processes = [subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for cmd in cmds]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
    log_launch([*cmds[0], f"(the first of {len(cmds)} nodes' commands)"], time.perf_counter() - started)
    for p, output in zip(processes, outputs):
        assert p.returncode == 0, output[-4000:]
    return "\n".join(outputs)


def deepspeed_cmd(hostfile, port, *launcher_args):
    return [str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--master_addr", HOSTS[0],
            "--master_port", str(port), *launcher_args, "app/train.py", *ARGS]


def test_deepspeed_through_pdsh_and_ssh(cluster, reference, tmp_path):
    """`deepspeed --hostfile`: pdsh starts launch.py on each host over a real ssh connection."""
    before, out = shm_segments(), tmp_path / "run"
    output = launch(deepspeed_cmd(TWO_HOSTS, free_port()) + ["--output_dir", str(out)],
                    cluster.env(MLFLOW_TRACKING_TOKEN="tok-5e1d"))
    check_run(out, output, reference, "deepspeed", f"2 node(s): {HOSTS[0]} (rank 0), {HOSTS[1]} (rank 1)", before)
    # pdsh prefixes each line with the host it came from: node 1 ran its own launch.py
    assert f"{HOSTS[1]}: " in output and f"{HOSTS[0]}: mode: started by deepspeed" in output
    # the runner exports MLFLOW* on pdsh's command line, for every user's `ps` to read: rank 0 says so, once
    warned = [line for line in output.splitlines() if "MLFLOW_TRACKING_TOKEN travels to the nodes" in line]
    assert len(warned) == 1 and warned[0].startswith(f"{HOSTS[0]}: warning: "), output[-3000:]


def test_shell_code_that_pdsh_handed_the_nodes_stops_the_run(cluster, tmp_path):
    """DeepSpeed's pdsh runner passes `$(...)` in an argument to each node's shell, which runs it before the app
    starts (tests/unit/test_node_shell.py: the doctor refuses it first); rank 0 then ends the run in one line."""
    out = tmp_path / "run"
    result = run(deepspeed_cmd(TWO_HOSTS, free_port()) + ["--output_dir", f"{out}$(touch {tmp_path}/ran)"],
                 timeout=300, **cluster.env())
    assert result.returncode != 0
    assert_one_error_line(result.stdout + result.stderr, "handed every node's shell '$('", anywhere=True)
    assert (tmp_path / "ran").exists() and not out.exists()  # it ran on the nodes; nothing of the run was written


def test_a_host_name_that_is_an_ssh_option_stops_the_run(cluster, tmp_path):
    """A second host `-oProxyCommand=...` passes DeepSpeed's ssh check (it tries the first host only) and reaches
    pdsh; the rank that starts ends the run naming it (the doctor refuses the hostfile before any launch)."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{HOSTS[0]} slots=1\n-oProxyCommand=touch${{IFS}}{tmp_path}/ran slots=1\n")
    result = run(deepspeed_cmd(hostfile, free_port()) + ["--dist_timeout", "10", "--output_dir", str(tmp_path / "run")],
                 timeout=300, **cluster.env())
    assert result.returncode != 0
    assert_one_error_line(result.stdout + result.stderr, "begins with '-', which ssh reads as an option",
                          anywhere=True)
    assert not (tmp_path / "run").exists()


def test_deepspeed_no_ssh_one_launcher_per_node(cluster, reference, tmp_path):
    """`deepspeed --hostfile --no_ssh --node_rank K` typed on each node, no ssh at all."""
    before, out, port = shm_segments(), tmp_path / "run", free_port()
    hostfile = TWO_HOSTS
    output = launch_per_node([deepspeed_cmd(hostfile, port, "--no_ssh", "--node_rank", str(k)) +
                              ["--output_dir", str(out)] for k in range(2)], {"HF_HUB_OFFLINE": "1"})
    check_run(out, output, reference, "deepspeed", f"2 node(s): {HOSTS[0]} (rank 0), {HOSTS[1]} (rank 1)", before)


def test_deepspeed_openmpi(cluster, reference, tmp_path):
    """`deepspeed --launcher openmpi`: mpirun starts the ranks, the app reads OMPI_COMM_WORLD_*."""
    before, out, port = shm_segments(), tmp_path / "run", free_port()
    # DeepSpeed's OpenMPI runner passes neither --master_addr nor --master_port on: .deepspeed_env does
    env = cluster.env(deepspeed_env={"MASTER_ADDR": HOSTS[0], "MASTER_PORT": port})
    loopback_only = "--mca btl_tcp_if_include lo --mca oob_tcp_if_include lo"
    output = launch(deepspeed_cmd(TWO_HOSTS, port, "--launcher", "openmpi", "--launcher_args",
                                  loopback_only) + ["--output_dir", str(out)], env)
    host = socket.gethostname()  # both "nodes" are this machine: mpirun's node order tells them apart
    check_run(out, output, reference, "mpirun", f"2 node(s): {host}#0 (rank 0), {host}#1 (rank 1)", before)


def test_slurm_sbatch_script_with_srun(cluster, reference, tmp_path):
    """scripts/train.sbatch as a user submits it; srun starts the tasks, the app reads SLURM_*. The same script run
    again (as a requeued job is) continues from its checkpoint instead of refusing the folder."""
    before, out, log = shm_segments(), tmp_path / "run", tmp_path / "slurm.out"
    submit = ["sbatch", "--wait", "--nodes=1", "--ntasks-per-node=2", f"--output={log}", "scripts/train.sbatch",
              *ARGS, "--output_dir", str(out)]
    launch(submit, cluster.env(HF_HUB_OFFLINE="1"), timeout=300)
    check_run(out, log.read_text(), reference, "srun", "1 node(s): localhost (ranks 0-1)", before)
    launch(submit, cluster.env(HF_HUB_OFFLINE="1"), timeout=300)
    assert "nothing to do" in log.read_text(), log.read_text()[-3000:]


def test_torchrun_c10d_rendezvous_two_nodes(reference, tmp_path):
    """Two torchrun agents, one per "node" address, meeting through a c10d rendezvous."""
    before, out, port = shm_segments(), tmp_path / "run", free_port()
    output = launch_per_node([[str(BIN / "torchrun"), "--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend",
                               "c10d", "--rdzv_endpoint", f"{HOSTS[0]}:{port}", "--rdzv_id", "two-nodes",
                               "--local_addr", host, "app/train.py", *ARGS, "--output_dir", str(out)]
                              for host in HOSTS], {"HF_HUB_OFFLINE": "1"})
    host = socket.gethostname()
    check_run(out, output, reference, "torchrun", f"2 node(s): {host}#0 (rank 0), {host}#1 (rank 1)", before)


def test_a_host_that_is_down_fails_the_launch_soon_naming_it(cluster, tmp_path):
    """No sshd answers on DOWN_HOST: rank 0 stops waiting for it after --dist_timeout (5 s here) and says which host."""
    started = time.monotonic()
    result = run(deepspeed_cmd(cluster.hostfile(HOSTS[0], DOWN_HOST), free_port()) +
                 ["--dist_timeout", "5", "--output_dir", str(tmp_path / "run")], timeout=300, **cluster.env())
    elapsed = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert elapsed < 120, f"took {elapsed:.0f} s"
    assert_one_error_line(output, DOWN_HOST, "did not start within 5 s", "python -m app.tools.doctor", anywhere=True)
    assert not (tmp_path / "run" / "metrics.csv").exists()
