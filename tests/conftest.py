"""Shared helpers: run the app for real (subprocess, real launchers) and read what it wrote."""
import csv
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # tests never reach a model hub or dataset host
REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_command(launcher: str, nproc: int, *args) -> list:
    """The command a user would type for this launcher."""
    args = [str(a) for a in args]
    if launcher == "python":
        return [sys.executable, "app/train.py", *args]
    if launcher == "deepspeed":
        return [str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(free_port()),
                "app/train.py", *args]
    if launcher == "torchrun":
        return [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(free_port()),
                "app/train.py", *args]
    raise ValueError(launcher)


def run(cmd, timeout=600, **env) -> subprocess.CompletedProcess:
    """Run cmd in the repository root with the test environment; output captured as text."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full_env)


def train(launcher="python", nproc=1, *args, timeout=600):
    """Run a training job and fail the test with its output if it did not exit 0."""
    result = run(train_command(launcher, nproc, *args), timeout=timeout)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


def read_metrics(output_dir: Path):
    """(train rows, eval rows) from metrics.csv, numbers parsed."""
    with open(output_dir / "metrics.csv") as f:
        rows = [{k: (float(v) if v != "" else None) for k, v in row.items()} for row in csv.DictReader(f)]
    return [r for r in rows if r["loss"] is not None], [r for r in rows if r["eval_loss"] is not None]


def read_summary(output_dir: Path) -> dict:
    return json.loads((output_dir / "summary.json").read_text())


def config_variant(tmp_path: Path, name: str, **changes) -> Path:
    """A copy of ds_configs/<name>.json with top-level keys changed, written under tmp_path."""
    ds = json.loads((REPO / "ds_configs" / f"{name}.json").read_text())
    ds.update(changes)
    path = tmp_path / f"{name}-variant.json"
    path.write_text(json.dumps(ds))
    return path


# The standard 2-rank run of a ds_config: 2 epochs of 23 steps (1,437 digits / (32 x 2 ranks)), a
# metrics row every step and a checkpoint every 5. The end-to-end and the resume tests share it.
TWO_RANK_ARGS = ["--epochs", 2, "--log_interval", 1, "--save_interval", 5, "--keep_last", 3]
TWO_RANK_STEPS = 46


@pytest.fixture(scope="session")
def two_rank_run(tmp_path_factory):
    """name -> (output_dir, stdout) of the standard 2-rank run of ds_configs/<name>.json, made once."""
    done = {}

    def get(name):
        if name not in done:
            out = tmp_path_factory.mktemp(f"two-rank-{name}") / "run"
            result = train("deepspeed", 2, "--deepspeed_config", REPO / "ds_configs" / f"{name}.json",
                           *TWO_RANK_ARGS, "--output_dir", out)
            done[name] = out, result.stdout
        return done[name]
    return get


@pytest.fixture
def repo():
    return REPO
