"""The forks the tests run single-process commands in (tests/helpers/forks.py) behave as `python ...` does."""
import subprocess
import sys

import pytest

from conftest import REPO
from helpers.forks import run_python

SCRIPT = """import os, signal, sys
print("argv", sys.argv, "main", __name__, "path0", sys.path[0], "file", __file__)
print("env", sorted(k for k in os.environ if k.startswith("FORK_")), os.getcwd())
print("to stderr", file=sys.stderr)
how = sys.argv[1]
if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if how == "hang":
    signal.pause()
if how == "raise":
    raise ValueError("boom")
sys.exit(int(how))
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.parametrize("how, code", [("0", 0), ("2", 2), ("kill", -9), ("raise", 1)])
def test_a_fork_ends_as_the_python_command_would(how, code, script, tmp_path):
    got = run_python([script.name, how], {"FORK_A": "1", "PYTHONUNBUFFERED": "1"}, tmp_path, timeout=60)
    want = subprocess.run([sys.executable, script.name, how], cwd=tmp_path, capture_output=True, text=True,
                          env={"FORK_A": "1", "PYTHONUNBUFFERED": "1"})
    assert got.returncode == want.returncode == code
    assert got.stdout == want.stdout and got.stdout.startswith(f"argv ['{script.name}', '{how}'] main __main__ path0 "
                                                               f"{tmp_path} file {script}")
    assert ("Traceback" in got.stderr and "ValueError: boom" in got.stderr) == (how == "raise")
    assert "to stderr" in got.stderr


@pytest.mark.parametrize("threads", [None, "1"])
def test_a_fork_takes_its_threads_from_omp_num_threads_as_python_would(threads, tmp_path):
    (tmp_path / "threads.py").write_text("import torch\nprint(torch.get_num_threads())\n")
    env = {"OMP_NUM_THREADS": threads} if threads else {}
    got = run_python(["threads.py"], env, tmp_path, timeout=60)
    want = subprocess.run([sys.executable, "threads.py"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert got.returncode == want.returncode == 0 and got.stdout == want.stdout, (got.stderr, want.stderr)


def test_a_module_runs_as_main_and_a_fork_that_outlives_its_timeout_is_killed(tmp_path):
    got = run_python(["-m", "app.tools.export", "--help"], {}, REPO, timeout=60)
    assert got.returncode == 0 and "usage:" in got.stdout and "RuntimeWarning" not in got.stderr
    (tmp_path / "probe.py").write_text(SCRIPT)
    with pytest.raises(subprocess.TimeoutExpired):
        run_python([tmp_path / "probe.py", "hang"], {}, tmp_path, timeout=2)


def test_ranks_see_the_launcher_variables_and_one_failing_ends_the_others(tmp_path):
    """run_ranks starts each rank as the deepspeed launcher would (its variables, --local_rank=N); when a rank exits
    non-zero, the ones still running are ended and the run returns that code, as the launcher does."""
    from helpers.forks import run_ranks
    (tmp_path / "ranks.py").write_text("""import os, signal, sys
print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], "local", os.environ["LOCAL_RANK"], sys.argv[1:])
sys.stdout.flush()
if sys.argv[1] == "fail" and os.environ["RANK"] == "1":
    sys.exit(3)
if sys.argv[1] == "fail":
    signal.pause()
""")
    got = run_ranks(2, [tmp_path / "ranks.py", "ok"], {"PYTHONUNBUFFERED": "1"}, tmp_path, timeout=60)
    assert got.returncode == 0
    assert got.stdout == "rank 0 of 2 local 0 ['ok', '--local_rank=0']\nrank 1 of 2 local 1 ['ok', '--local_rank=1']\n"
    got = run_ranks(2, [tmp_path / "ranks.py", "fail"], {"PYTHONUNBUFFERED": "1"}, tmp_path, timeout=60)
    assert got.returncode == 3 and "rank 0 of 2" in got.stdout, "rank 0, paused, was ended when rank 1 failed"


def _rank_probe(rank, world, fail_on):
    import os
    import signal
    print("rank", rank, "of", world, "sees", os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"],
          flush=True)
    if rank == fail_on:
        raise ValueError(f"boom on rank {rank}")
    if fail_on is not None:
        signal.pause()


def test_a_function_on_ranks_sees_their_variables_and_one_raising_ends_the_others(tmp_path):
    """call_ranks runs a function on each rank with the launcher's variables; one that raises prints its traceback
    and exits 1, and the ranks still running are ended, as run_ranks does for a script."""
    from helpers.forks import call_ranks
    got = call_ranks(2, _rank_probe, (None,), {}, tmp_path, timeout=60)
    assert got.returncode == 0 and got.stdout == "rank 0 of 2 sees 0 2 0\nrank 1 of 2 sees 1 2 1\n"
    got = call_ranks(2, _rank_probe, (1,), {}, tmp_path, timeout=60)
    assert got.returncode == 1 and "rank 0 of 2" in got.stdout, "rank 0, paused, was ended when rank 1 raised"
    assert "Traceback" in got.stderr and "ValueError: boom on rank 1" in got.stderr
