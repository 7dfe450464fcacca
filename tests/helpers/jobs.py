"""Several app/train.py jobs in one process group, started once (the tests share its start-up): by
conftest.launch_script, as forks with the deepspeed launcher's variables on the CPU, or by the launcher itself:

    deepspeed --num_gpus 2 tests/helpers/jobs.py <jobs.json> <report folder>

jobs.json holds a list of train.py argument lists, or of {"argv": [...], "env": {...}} for a job that needs
variables of its own (the faults of tests/helpers/faults.py). For job i each rank writes what it printed, stdout
and stderr, to <report folder>/<i>.rank<r>.txt, its exit code to <i>.rank<r>.code and its seconds to
<i>.rank<r>.seconds, as if it had been its own launch: a job that ends in a user error says its one line and
exits 2, and the next job runs.
"""
import contextlib
import gc
import json
import os
import sys
import tempfile
import time
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch._dynamo  # noqa: E402

from app import train  # noqa: E402
from app import settings as config
from app.distributed import dist
from app.distributed import launch
from app.errors import Ended, UserError, report as say  # noqa: E402
from app.tools.bench_modes import forget_engines


@contextlib.contextmanager
def variables(env: dict):
    """The environment with env set, as it was afterwards."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)


@contextlib.contextmanager
def zero_numbering_kept():
    """ZeRO-3's parameter numbering (zero.Init's, process-wide) as it was before the job: each job numbers its
    parameters as a process of its own would, as offload to NVMe names its swap files and a checkpoint's offloaded
    tensors by those numbers (a resume job after others would not find its files otherwise)."""
    from deepspeed.runtime.zero.partition_parameters import Init
    saved = Init.param_id
    try:
        yield
    finally:
        Init.param_id = saved


def engines_built() -> list:
    """Weak references to each DeepSpeed engine this process builds from now on (whole: one whose build raised has
    nothing to let go of)."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    built, init = [], DeepSpeedEngine.__init__

    def recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(weakref.ref(self))
    DeepSpeedEngine.__init__ = recorded
    return built


def let_go(built: list):
    """Let go of the engines a job built, as the benchmark does between its modes: each engine's destroy() removes
    its hooks on the parameters (held by torch's autograd, out of gc's sight), forget_engines() what DeepSpeed's
    globals keep (ZeRO-3's coordinator keeps every engine it served): a later job starts without them, as in a
    process of its own, its peak memory its own."""
    gc.collect()
    for engine in filter(None, (ref() for ref in built)):
        engine.destroy()
    built.clear()
    forget_engines()
    gc.collect()


def main(jobs_file: str, report: str):
    gc.freeze()  # as app/train.py's main: the imports' objects stay out of every job's collections
    launch.prepare_environment()
    jobs = [job if isinstance(job, dict) else {"argv": job} for job in json.loads(Path(jobs_file).read_text())]
    parsed = [(config.parse([str(a) for a in job["argv"]]), job.get("env", {})) for job in jobs]
    world = launch.setup(timeout_s=300)
    built = engines_built()
    # one file for every job's output, emptied before each, as a launch's output is a file: what asks sys.stderr for
    # its descriptor (DeepSpeed's op checks) gets one, and a log handler a job made keeps an open one
    printed = tempfile.TemporaryFile("w+", encoding="utf-8")
    try:
        for i, ((settings, ds), env) in enumerate(parsed):
            printed.seek(0)
            printed.truncate()
            started = time.perf_counter()
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed), variables(env), \
                    zero_numbering_kept():
                try:
                    code = train.run(settings, ds, world, time.perf_counter())
                except (UserError, Ended) as e:
                    code = say(e)
            printed.seek(0)
            (Path(report) / f"{i}.rank{world.rank}.txt").write_text(printed.read())
            (Path(report) / f"{i}.rank{world.rank}.code").write_text(str(code))
            (Path(report) / f"{i}.rank{world.rank}.seconds").write_text(f"{time.perf_counter() - started:.2f}")
            torch._dynamo.reset()  # a compiled job starts from an empty compile cache, as in its own process
            let_go(built)
    finally:
        printed.close()
        dist.teardown()


if __name__ == "__main__":
    main(*[a for a in sys.argv[1:] if not a.startswith("--local_rank")])
    train.exit_now(0)
