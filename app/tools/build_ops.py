"""Build the DeepSpeed JIT ops the shipped ds_configs use, and DeepSpeed's fused Adam, once during set-up, so the
first run starts in seconds.

Each op compiles on first use (30-90 s here, a CUDA build on a GPU machine): building one no config uses
would only slow every fresh set-up down. The fused Adam is the op of the configs people bring from other projects
("type": "Adam" or "AdamW" without "torch_adam", as transformers', accelerate's and DeepSpeed's examples write).
"""
import json
import time
from pathlib import Path

from app.errors import first_line

CONFIGS = Path(__file__).resolve().parents[2] / "ds_configs"


def ops_for(ds: dict, accelerator: str) -> set:
    """The op builders a DeepSpeed dict loads on an accelerator ('cpu' or 'cuda')."""
    ops = set()
    zero = ds.get("zero_optimization") or {}
    optimizer = ds.get("optimizer") or {}
    adam = optimizer.get("type", "").lower() in ("adam", "adamw")
    if (zero.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme"):
        ops.add("CPUAdamBuilder")  # DeepSpeedCPUAdam runs the step on the host
    elif adam and not optimizer.get("params", {}).get("torch_adam", False):
        ops.add("FusedAdamBuilder")  # DeepSpeed's own Adam kernel; "torch_adam": true takes torch's
    if accelerator == "cpu":
        ops.add("ShareMemCommBuilder")  # deepspeed.init_distributed loads it for its CPU all-reduce
    return ops


def shipped_ops(accelerator: str) -> set:
    """Every op the files in ds_configs/ load on this accelerator."""
    return set().union(*(ops_for(json.loads(p.read_text()), accelerator) for p in CONFIGS.glob("*.json")))


def setup_ops(accelerator: str) -> set:
    """What set-up builds: the shipped configs' ops and the fused Adam of the configs people bring."""
    return shipped_ops(accelerator) | {"FusedAdamBuilder"}


def main():
    """Load (compiling where not cached) each op set-up builds on this machine's accelerator."""
    from app.distributed.launch import prepare_environment
    prepare_environment()
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    for name in sorted(setup_ops(accelerator.device_name())):
        builder_class = accelerator.get_op_builder(name)
        if builder_class is None:
            continue
        builder = builder_class()
        if not builder.is_compatible(verbose=False):
            print(f"{name}: not compatible with this machine, skipped")
            continue
        start = time.perf_counter()
        try:
            builder.load(verbose=False)
        except Exception as e:  # noqa: BLE001 (no CUDA_HOME or nvcc, no compiler: set-up goes on without the op)
            print(f"{name}: cannot be built here ({first_line(e)}); a run whose config needs it fails at start "
                  f"until it can (`ds_report` says what this machine lacks)", flush=True)
            continue
        print(f"{name}: ready ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
