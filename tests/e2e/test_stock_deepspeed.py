"""The app's changes to DeepSpeed's step (app/ds/internals/) against stock DeepSpeed, on 2 gloo ranks: the same
weights, learning rates and count of skipped steps, step after step, with a step whose gradients are NaN among them
(tests/helpers/stock_steps.py; docs/gpu.md lists every change and its proof). test_cuda.py runs the same on a GPU."""
import tempfile

import pytest

from conftest import REPO, launch_script
from helpers.stock_steps import bf16_weights_config, cases_in, judge, losses_against_stock

# stage:precision:how often the loop reads what the device counted (1: every step; 4: a log row every 4 steps)
CASES = ["0:fp32:1", "1:fp32:1", "2:fp32:1", "3:fp32:1", "0:bf16:1", "1:bf16:1", "2:bf16:1", "3:bf16:1", "2:fp32:4"]


def test_the_apps_step_is_stock_deepspeeds_and_a_step_skipped_on_the_device_counts_as_deepspeed_counts_it():
    """Bit for bit: the plain fp32 clip of ZeRO 0, the step skipped on the device under ZeRO 1-3 and bf16 weights,
    counted and holding the schedule back as DeepSpeed's own host check does; read at a log row, the schedule runs
    ahead from the skipped step to the read and is set back there."""
    with tempfile.TemporaryDirectory() as report:
        result = launch_script(2, "tests/helpers/stock_steps.py", report, *CASES)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        for case, seen in cases_in(report, CASES, 2):
            judge(case, seen)


def test_a_run_trains_the_losses_it_trains_on_stock_deepspeed(tmp_path):
    """Whole runs (the digits CNN, 2 ranks, 8 steps): the app's losses step by step against the same runs with every
    change of the app to DeepSpeed's step turned off from outside (tests/helpers/stock_deepspeed.py)."""
    configs = {"zero3": REPO / "ds_configs" / "zero3.json", "bf16-zero0": bf16_weights_config(tmp_path, 0)}
    differences = losses_against_stock(tmp_path, configs, ["--max_steps", 8], nproc=2)
    assert differences == {"zero3": 0.0, "bf16-zero0": pytest.approx(0.0, abs=1e-6)}, differences
