"""The tests' single-process commands and spawned ranks, each a fork of one interpreter that has already imported
torch, DeepSpeed, transformers and the app: that import is most of a short run's time (docs/tests.md).

Each fork is its own process, started from the same state: it runs `python <script> ...` or `python -m <module>
...` as the interpreter would (sys.argv, sys.path[0], the working folder, the whole environment replaced, atexit
handlers at the end, unbuffered output to its own files), its exit code or the signal that ended it returned as
subprocess.run returns them. multiprocessing's forkserver starts the interpreter once per session, in the
environment of the first call; what it imports is tests/helpers/preload.py.
"""
import atexit
import contextlib
import io
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def context():
    """The forkserver context, its interpreter started and preloaded at the first call. The forkserver imports what
    it preloads with the path of a plain `python -c` in its working folder (it does not take this process's), so
    it starts in the repository, which has tests/helpers/preload.py."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.helpers.preload"])
    with contextlib.chdir(REPO):
        multiprocessing.forkserver.ensure_running()
    return ctx


def _output_to(out: str, err: str):
    """Standard output and error to these files, unbuffered (PYTHONUNBUFFERED=1, which the tests set)."""
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)


def _as_python(argv: list, env: dict, cwd: str, out: str, err: str):
    """In the fork: run argv as `python *argv` would, then exit with its code."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    _output_to(out, err)
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, cwd)
            sys.modules.pop(argv[1], None)  # imported by the preload: run afresh as __main__
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, str(Path(cwd, argv[0]).resolve().parent))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else (print(e.code, file=sys.stderr), 1)[1])
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_python(argv: list, env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """`python *argv` in cwd with exactly env, as a fork of the preloaded interpreter; like subprocess.run with
    capture_output=True and text=True (an exit by signal N is returncode -N)."""
    with tempfile.TemporaryDirectory(prefix="fork-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        process = context().Process(target=_as_python, args=([str(a) for a in argv], dict(env), str(cwd), str(out),
                                                              str(err)))
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, out.read_text(), err.read_text())
        return subprocess.CompletedProcess([sys.executable, *argv], process.exitcode,
                                           out.read_text(errors="replace"), err.read_text(errors="replace"))
