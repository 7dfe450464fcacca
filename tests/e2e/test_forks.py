"""The forks the tests run single-process commands in (tests/helpers/forks.py) behave as `python ...` does."""
import subprocess
import sys

import pytest

from conftest import REPO
from helpers.forks import run_python

SCRIPT = """import os, signal, sys
print("argv", sys.argv, "main", __name__, "path0", sys.path[0])
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
    got = run_python([script, how], {"FORK_A": "1", "PYTHONUNBUFFERED": "1"}, tmp_path, timeout=60)
    want = subprocess.run([sys.executable, script, how], cwd=tmp_path, capture_output=True, text=True,
                          env={"FORK_A": "1", "PYTHONUNBUFFERED": "1"})
    assert got.returncode == want.returncode == code
    assert got.stdout == want.stdout and got.stdout.startswith(f"argv ['{script}', '{how}'] main __main__ path0 "
                                                               f"{tmp_path}")
    assert ("Traceback" in got.stderr and "ValueError: boom" in got.stderr) == (how == "raise")
    assert "to stderr" in got.stderr


def test_a_module_runs_as_main_and_a_fork_that_outlives_its_timeout_is_killed(tmp_path):
    got = run_python(["-m", "app.tools.export", "--help"], {}, REPO, timeout=60)
    assert got.returncode == 0 and "usage:" in got.stdout and "RuntimeWarning" not in got.stderr
    (tmp_path / "probe.py").write_text(SCRIPT)
    with pytest.raises(subprocess.TimeoutExpired):
        run_python([tmp_path / "probe.py", "hang"], {}, tmp_path, timeout=2)
