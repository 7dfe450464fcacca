"""The run folder's lock between real runs: a second run on a folder in use ends in one line naming the first, and
takes the lock over once the first is killed. The rest of the run folder: tests/unit/test_outdir.py."""
import signal
import socket
import subprocess
import time


from app.checkpoint import outdir
from conftest import REPO, assert_one_error_line, run, train_command


def test_two_runs_on_one_folder(tmp_path):
    """A second run on a folder in use ends in one line naming the first (host, pid); once the first is killed,
    the next run takes its lock over and goes on."""
    out = tmp_path / "run"
    first = subprocess.Popen(train_command("python", 1, "--max_steps", 100000, "--output_dir", out), cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.csv").is_file() and time.monotonic() < deadline:  # training has begun
            time.sleep(0.2)
        second = run(train_command("python", 1, "--max_steps", 2, "--output_dir", out, "--resume", "auto"))
        assert second.returncode == 2
        assert_one_error_line(second.stderr, f"output directory {out} is in use by another run (host "
                                             f"{socket.gethostname()}, pid {first.pid})")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    third = run(train_command("python", 1, "--max_steps", 2, "--output_dir", out, "--resume", "auto"))
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"took over the lock of a run that ended without releasing it (host {socket.gethostname()}, pid " \
           f"{first.pid})" in third.stdout
    assert not (out / outdir.LOCK).exists(), "released at the end"
