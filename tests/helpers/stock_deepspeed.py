"""Run a script (app/train.py, tests/helpers/jobs.py) on stock DeepSpeed: every change the app makes to DeepSpeed's
step (app/ds/internals/, listed in docs/gpu.md) turned off from outside the app, so a run's losses can be compared
with the app's own.

    deepspeed --num_gpus 1 tests/helpers/stock_deepspeed.py <script> <its arguments>
"""
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

CHANGES = ("lighten_plain_step", "note_clip_norms", "skip_bad_steps_on_device", "step_bf16_weights_on_device",
           "constants_on_device")


def main():
    script, *argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher's
    from app.ds import internals
    for name in CHANGES:
        setattr(internals, name, lambda *args, **kwargs: False)
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
