"""Set-up builds the DeepSpeed ops the shipped configs load and the fused Adam of the configs people bring, and no
other (each is a minute of compiling)."""
import json

from app.tools.build_ops import ops_for, setup_ops, shipped_ops
from conftest import REPO


def test_the_shipped_configs_need_cpu_adam_and_on_a_cpu_the_shared_memory_all_reduce():
    assert shipped_ops("cpu") == {"CPUAdamBuilder", "ShareMemCommBuilder"}
    assert shipped_ops("cuda") == {"CPUAdamBuilder"}, "torch's fused AdamW needs no DeepSpeed kernel"
    assert setup_ops("cpu") == {"CPUAdamBuilder", "ShareMemCommBuilder", "FusedAdamBuilder"}


def test_which_config_loads_which_op():
    dp = json.loads((REPO / "ds_configs" / "dp.json").read_text())
    assert ops_for(dp, "cuda") == set()
    deepspeed_adam = {**dp, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    assert ops_for(deepspeed_adam, "cuda") == {"FusedAdamBuilder"}
    offload = json.loads((REPO / "ds_configs" / "zero3_offload.json").read_text())
    assert ops_for(offload, "cuda") == {"CPUAdamBuilder"}
    assert ops_for({"optimizer": {"type": "SGD"}}, "cpu") == {"ShareMemCommBuilder"}


def test_an_op_that_cannot_be_built_here_is_one_line_and_set_up_goes_on(tmp_path):
    """No compiler (here: CXX that fails; on a GPU machine, no CUDA_HOME or nvcc): each op says so in a line, and
    the set-up goes on rather than ending in a traceback."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "CXX": "/bin/false", "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "app.tools.build_ops"], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    said = [line for line in done.stdout.splitlines() if "cannot be built here" in line]
    assert {line.split(":")[0] for line in said} == setup_ops("cpu"), done.stdout
