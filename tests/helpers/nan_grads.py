"""Run a script (app/train.py, tests/helpers/jobs.py) with the gradients of some optimizer steps made NaN from
outside the app: DeepSpeed's engine.backward gets a hook on the loss that makes its gradient NaN, so the loss stays
finite and every gradient behind it is NaN.

    deepspeed --num_gpus 2 tests/helpers/nan_grads.py FIRST LAST <script> <its arguments>

Steps FIRST..LAST, counted as DeepSpeed counts them from 1, get NaN gradients; LAST 0: every step from FIRST on.
"""
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main():
    first, last, script, *argv = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher's
    first, last = int(first), int(last)
    from app.distributed import launch
    launch.prepare_environment()
    from deepspeed.runtime.engine import DeepSpeedEngine
    backward = DeepSpeedEngine.backward

    def backward_of_nan_gradients(self, loss, *args, **kwargs):
        step = self.global_steps + 1
        if first <= step and (not last or step <= last) and loss.requires_grad:
            loss.register_hook(lambda grad: grad * float("nan"))
        return backward(self, loss, *args, **kwargs)
    DeepSpeedEngine.backward = backward_of_nan_gradients
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
