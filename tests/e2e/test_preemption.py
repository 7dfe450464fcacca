"""Preemption and failure through the real deepspeed launcher with 2 ranks: signals save, kills end fast."""
import os
import signal
import subprocess
import time

import psutil
import pytest

from app.distributed import wire
from conftest import REPO, TWO_RANK_ARGS, log_launch, read_metrics, train_command, train_jobs, two_rank_steps


STEPS = 200  # long enough that the signal lands mid-run on this machine
LONG_RUN = ["--max_steps", STEPS, "--log_interval", 1]


def _start(out, *args):
    cmd = train_command("deepspeed", 2, *args, "--output_dir", out)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    launcher = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env=env)
    launcher.started = time.perf_counter()
    return launcher


def _output(launcher, timeout: float) -> str:
    """The launcher's output once it has exited (its run logged as conftest.log_launch logs commands)."""
    output = launcher.communicate(timeout=timeout)[0]
    log_launch(launcher.args, time.perf_counter() - launcher.started)
    return output


def _ranks(launcher):
    """The two training processes under the launcher, by local rank (not rank 0's rendezvous store, a process of
    its own beside it: app/distributed/wire.py)."""
    deadline = time.time() + 60
    while time.time() < deadline:
        found = {}
        for child in psutil.Process(launcher.pid).children(recursive=True):
            try:
                command = child.cmdline()
                if child.name() == wire.STORE_NAME:
                    continue
            except psutil.Error:
                continue
            for arg in command:
                if arg.startswith("--local_rank="):
                    found[int(arg.split("=")[1])] = child
        if len(found) == 2:
            return found
        time.sleep(0.1)
    raise AssertionError("the launcher did not start 2 ranks")


def _wait_for_step(out, step, launcher):
    """Block until metrics.csv shows training has reached step."""
    deadline = time.time() + 120
    while time.time() < deadline and launcher.poll() is None:
        if (out / "metrics.csv").exists() and len(read_metrics(out)[0]) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"training did not reach step {step}: {launcher.communicate()[0][-3000:]}")


def _saved_step(out) -> int:
    return int((out / "checkpoints" / "latest").read_text()[4:])


SIGNALLED = ("dp", "pipeline")


def _config(name: str) -> list:
    return ["--deepspeed_config", REPO / "ds_configs" / f"{name}.json", *TWO_RANK_ARGS]


def _sigterm_to_rank_1(out, name: str) -> tuple:
    """(exit code, output) of the standard 2-rank run of a config, rank 1 sent SIGTERM after step 10 (the pipeline's
    SIGUSR1, as Slurm's --signal=USR1@120 sends ahead of a time limit)."""
    launcher = _start(out, *_config(name))
    ranks = _ranks(launcher)
    _wait_for_step(out, 10, launcher)
    # Hold rank 1 while the signal is queued, so it lands mid-run however fast the steps are.
    ranks[1].suspend()
    ranks[1].send_signal(signal.SIGUSR1 if name == "pipeline" else signal.SIGTERM)
    ranks[1].resume()
    output = _output(launcher, 60)
    return launcher.returncode, output


@pytest.fixture(scope="module")
def signalled(tmp_path_factory):
    """name -> (exit code, output, the step saved, output_dir) of each config's run stopped by SIGTERM to rank 1,
    each in a launch of its own; then every stopped run resumed, one after another in one launch."""
    root = tmp_path_factory.mktemp("signalled")
    stopped = {}
    for name in SIGNALLED:
        code, output = _sigterm_to_rank_1(root / name, name)
        stopped[name] = code, output, _saved_step(root / name), root / name
    train_jobs("ranks", 2, [[*_config(name), "--output_dir", root / name, "--resume", "auto"]
                                for name in SIGNALLED])
    return stopped


@pytest.mark.parametrize("name", SIGNALLED)
def test_sigterm_to_one_rank_saves_and_resumes_exactly(name, signalled, two_rank_run):
    whole, _ = two_rank_run(name)
    code, output, step, stopped = signalled[name]
    steps = two_rank_steps(name)
    assert code == 0, output[-3000:]
    assert 10 < step < steps and f"stopped at step {step} on request" in output, output[-3000:]
    assert output.count("stopped at step") == 1, "only rank 0 speaks"
    expected, got = read_metrics(whole)[0], read_metrics(stopped)[0]
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    assert [r["loss"] for r in got] == [r["loss"] for r in expected], "per-step losses identical"


@pytest.mark.parametrize("how", ["SIGTERM to the launcher", "SIGINT to the process group"])
def test_signal_to_the_launcher_saves_within_the_grace_period(how, tmp_path):
    out = tmp_path / "run"
    launcher = _start(out, *LONG_RUN, "--grace_period", 20)
    ranks = _ranks(launcher)
    _wait_for_step(out, 20, launcher)
    sent = time.time()
    if how.startswith("SIGTERM"):
        launcher.send_signal(signal.SIGTERM)
    else:
        os.killpg(launcher.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    _, alive = psutil.wait_procs(list(ranks.values()), timeout=30)
    assert not alive and time.time() - sent < 20, "every rank exits within the grace period"
    output = _output(launcher, 30)
    step = _saved_step(out)
    assert 20 < step < STEPS and f"stopped at step {step} on request" in output, output[-3000:]
    assert (out / "checkpoints" / f"step{step:08d}" / "manifest.json").is_file()
    if how.startswith("SIGTERM"):  # deepspeed's launch.py outlives its runner and reports each rank's exit
        assert output.count("exits successfully") == 2, output[-3000:]


def test_kill_9_of_one_rank_ends_the_run_fast(tmp_path):
    out = tmp_path / "run"
    launcher = _start(out, *LONG_RUN)
    ranks = _ranks(launcher)
    _wait_for_step(out, 20, launcher)
    killed = time.time()
    ranks[1].kill()
    _output(launcher, 30)
    survivors_gone, alive = psutil.wait_procs([ranks[0]], timeout=10)
    assert not alive, "the other rank does not hang in a collective"
    assert launcher.returncode != 0 and time.time() - killed < 10, launcher.returncode
