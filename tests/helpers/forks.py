"""The tests' single-process commands and spawned ranks, each a fork of one interpreter that has already imported
torch, DeepSpeed, transformers and the app: that import is most of a short run's time (docs/tests.md).

Each fork is its own process, started from the same state: it runs `python <script> ...` or `python -m <module>
...` as the interpreter would (sys.argv, sys.path[0], the working folder, the whole environment replaced, atexit
handlers at the end, unbuffered output to its own files), its exit code or the signal that ended it returned as
subprocess.run returns them. multiprocessing's forkserver starts the interpreter once per session, in the
environment of the first call; what it imports is tests/helpers/preload.py.
"""
import atexit
import builtins
import contextlib
import functools
import io
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import runpy
import subprocess
import sys
import tempfile
import time
import types
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


def _exit_code(value) -> int:
    """The exit code python gives sys.exit(value): an int as it is, None as 0, anything else printed and 1."""
    if value is None or isinstance(value, int):
        return value or 0
    print(value, file=sys.stderr)
    return 1


def _in_fork(body, env: dict, cwd: str, out: str, err: str):
    """In the fork: in cwd with exactly env and its output to out and err, run body() as python runs a program
    (an uncaught exception printed, SystemExit's code kept, atexit handlers at the end), then exit with its code."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    _threads_from(env)
    _output_to(out, err)
    code = 0
    try:
        body()
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _threads_from(env: dict):
    """A python started afresh takes torch's CPU threads from OMP_NUM_THREADS; the preload's torch was imported
    under the forkserver's environment, so a fork given OMP_NUM_THREADS sets them as that start would."""
    if env.get("OMP_NUM_THREADS", "").isdigit():
        import torch
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))


def _as_python(argv: list):
    """What `python *argv` runs, in the fork's working folder."""
    cwd = os.getcwd()
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path.insert(0, cwd)
        sys.modules.pop(argv[1], None)  # imported by the preload: run afresh as __main__
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, str(Path(cwd, argv[0]).resolve().parent))
        _run_script(os.path.abspath(argv[0]))


def _run_script(path: str):
    """Run the file at path as __main__ as python does: its code and __file__ carry the absolute path, while
    sys.argv[0] stays as typed (runpy.run_path would set it to the path)."""
    main = types.ModuleType("__main__")
    main.__file__, main.__builtins__ = path, builtins
    sys.modules["__main__"] = main
    exec(compile(Path(path).read_bytes(), path, "exec"), main.__dict__)


def run_python(argv: list, env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """`python *argv` in cwd with exactly env, as a fork of the preloaded interpreter; like subprocess.run with
    capture_output=True and text=True (an exit by signal N is returncode -N)."""
    return run_together([_python(argv)], [env], cwd, timeout, [sys.executable, *argv])


def run_ranks(nproc: int, argv: list, env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus nproc *argv` on this CPU without the launcher's own start-up: nproc forks each running
    `python *argv` with the variables the launcher gives its rank (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_PORT...) and
    its `--local_rank=N`. Like the launcher, it ends the other ranks when one exits non-zero and returns that code."""
    return run_together([_python([*argv, f"--local_rank={rank}"]) for rank in range(nproc)], _rank_envs(nproc, env),
                        cwd, timeout, [f"{nproc} ranks:", *argv])


def call_ranks(nproc: int, fn, args: tuple, env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """fn(rank, nproc, *args) on nproc forks, each with the launcher's variables for its rank, as run_ranks starts a
    script; fn and args are pickled to the forks (fn a module's top-level function). A rank whose fn raises prints
    the traceback and exits 1."""
    return run_together([functools.partial(fn, rank, nproc, *args) for rank in range(nproc)], _rank_envs(nproc, env),
                        cwd, timeout, [f"{nproc} ranks:", f"{fn.__module__}.{fn.__qualname__}"])


def _python(argv: list):
    return functools.partial(_as_python, [str(a) for a in argv])


def _rank_envs(nproc: int, env: dict) -> list:
    from app.distributed.launch import free_port, rank_env
    port = free_port()
    return [{**env, **rank_env(rank, nproc, port)} for rank in range(nproc)]


def run_together(bodies: list, envs: list, cwd: Path, timeout: float, command: list) -> subprocess.CompletedProcess:
    """One fork per (body, env) pair, each running body() as a program in cwd with exactly env; their outputs joined
    in that order, under command (what the whole stands for). The first non-zero exit
    ends the others (SIGTERM, SIGKILL 5 s later) and is the returncode; past timeout every fork is killed and
    TimeoutExpired raised."""
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="fork-") as folder:
        outputs = [(Path(folder) / f"{i}.out", Path(folder) / f"{i}.err") for i in range(len(envs))]
        processes = [context().Process(target=_in_fork, args=(body, dict(env), str(cwd), str(out), str(err)))
                     for body, env, (out, err) in zip(bodies, envs, outputs)]
        for process in processes:
            process.start()
        failed = _wait(processes, deadline)
        stdout, stderr = ("".join(o.read_text(errors="replace") if o.exists() else "" for o in files)
                          for files in zip(*outputs))  # a fork that died before its first line has no file
        if failed is None:
            raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
        return subprocess.CompletedProcess(command, failed, stdout, stderr)


def _wait(processes: list, deadline: float):
    """The first non-zero exit code among processes, else 0, once all have ended; None if the deadline came first.
    Whatever is still running then is ended."""
    code, running = 0, list(processes)
    while running and code == 0:
        ended = multiprocessing.connection.wait([p.sentinel for p in running], max(0.0, deadline - time.monotonic()))
        if not ended:
            code = None
            break
        for process in [p for p in running if p.sentinel in ended]:
            process.join()
            running.remove(process)
            code = code or process.exitcode
    for process in running:  # after a failure, SIGTERM as the launcher sends; past the deadline, SIGKILL
        if code is None:
            process.kill()
        else:
            process.terminate()
    for process in running:
        process.join(5)
        if process.exitcode is None:
            process.kill()
            process.join()
    return code
