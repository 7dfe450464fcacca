"""Several app/train.py jobs in one process group, started once by a real launcher (the tests share its start-up).

    deepspeed --num_gpus 2 tests/jobs.py <jobs.json> <report folder>

jobs.json holds a list of train.py argument lists. For job i each rank writes what it printed to
<report folder>/<i>.rank<r>.txt and its exit code to <i>.rank<r>.code, as if it had been its own launch.
"""
import contextlib
import io
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch._dynamo  # noqa: E402

from app import config, dist, launch, train  # noqa: E402


def main(jobs_file: str, report: str):
    launch.prepare_environment()
    parsed = [config.parse([str(a) for a in argv]) for argv in json.loads(Path(jobs_file).read_text())]
    world = launch.setup(timeout_s=300)
    try:
        for i, (settings, ds) in enumerate(parsed):
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                code = train.run(settings, ds, world, time.perf_counter())
            (Path(report) / f"{i}.rank{world.rank}.txt").write_text(printed.getvalue())
            (Path(report) / f"{i}.rank{world.rank}.code").write_text(str(code))
            torch._dynamo.reset()  # a compiled job starts from an empty compile cache, as in its own process
    finally:
        dist.teardown()


if __name__ == "__main__":
    main(*[a for a in sys.argv[1:] if not a.startswith("--local_rank")])
    train.exit_now(0)
