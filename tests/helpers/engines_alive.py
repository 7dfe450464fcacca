"""Run a script (tests/helpers/jobs.py) saying, as each DeepSpeed engine is built, how many engines built before it
in this process are still alive: a job of a pool that starts beside an earlier job's engine holds that engine's
states too, which its peak memory then counts (ZeRO-3's parameter coordinator keeps every engine it served).

    python tests/helpers/engines_alive.py <script> <its arguments>
"""
import gc
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SAID = "engines of this process built before this one and alive: "


def main():
    script, *argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher's
    from app.distributed import launch
    launch.prepare_environment()
    from deepspeed.runtime.engine import DeepSpeedEngine
    from tests.helpers.jobs import engines_built
    built = engines_built()
    init = DeepSpeedEngine.__init__

    def counted(self, *args, **kwargs):
        gc.collect()
        print(f"{SAID}{sum(ref() is not None for ref in built)}", flush=True)
        init(self, *args, **kwargs)
    DeepSpeedEngine.__init__ = counted
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
