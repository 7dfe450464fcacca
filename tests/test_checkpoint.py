"""Checkpoints: a run killed with -9 and resumed computes exactly what an uninterrupted run does."""
import json
import os
import signal
import subprocess
import time

import pytest
import torch

from conftest import REPO, read_metrics, run, train, train_command

STEPS = ["--max_steps", 150, "--log_interval", 1, "--save_interval", 10, "--keep_last", 2]


def _kill_after_checkpoint(cmd, root, at_least):
    """Start cmd, wait until a checkpoint of step >= at_least is complete, then kill -9 every process."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    pointer = root / "checkpoints" / "latest_complete"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if pointer.exists() and int(pointer.read_text()[4:]) >= at_least:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return int(pointer.read_text()[4:])
        time.sleep(0.02)
    raise AssertionError(f"no checkpoint of step {at_least} appeared; exit {proc.poll()}: {proc.stderr.read()[-3000:]}")


def _weights(folder):
    state = torch.load(folder / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    return state


@pytest.mark.parametrize("name", ["dp", "zero2"])
def test_kill_and_resume_is_exact(name, tmp_path):
    config = REPO / "ds_configs" / f"{name}.json"
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    train("deepspeed", 2, "--deepspeed_config", config, *STEPS, "--output_dir", whole)
    saved_at = _kill_after_checkpoint(
        train_command("deepspeed", 2, "--deepspeed_config", config, *STEPS, "--output_dir", broken), broken, 40)
    assert saved_at < 150, "the kill landed before the run finished"
    result = train("deepspeed", 2, "--deepspeed_config", config, *STEPS, "--output_dir", broken, "--resume", "auto")
    assert f"resume: {broken / 'checkpoints' / f'step{saved_at:08d}'}" in result.stdout
    expected, got = read_metrics(whole)[0], read_metrics(broken)[0]
    assert [r["step"] for r in got] == list(range(1, 151)), "metrics.csv holds each step once"
    assert [r["loss"] for r in got] == [r["loss"] for r in expected], "per-step losses identical"
    final = "checkpoints/step00000150"
    if name == "dp":
        a, b = _weights(whole / final), _weights(broken / final)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    kept = sorted(p.name for p in (broken / "checkpoints").glob("step*"))
    assert kept[-2:] == ["step00000140", "step00000150"] and len(kept) <= 3, kept


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "run"
    train("python", 1, "--max_steps", 4, "--save_interval", 2, "--output_dir", out)
    return out


def _fails(result, text):
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and text in errors[0], result.stderr


def test_damaged_checkpoint_is_refused(saved_run, tmp_path):
    damaged = tmp_path / "run"
    subprocess.run(["cp", "-r", str(saved_run), str(damaged)], check=True)
    shard = damaged / "checkpoints" / "step00000004" / "mp_rank_00_model_states.pt"
    shard.write_bytes(shard.read_bytes()[:100])
    before = (damaged / "metrics.csv").read_bytes()
    result = run(train_command("python", 1, "--max_steps", 6, "--output_dir", damaged, "--resume", "auto"))
    _fails(result, "does not match its manifest")
    assert (damaged / "metrics.csv").read_bytes() == before


def test_resume_path_that_is_not_a_checkpoint(saved_run, tmp_path):
    result = run(train_command("python", 1, "--output_dir", tmp_path / "x", "--resume", saved_run))
    _fails(result, "is not a complete checkpoint")


def test_checkpoint_of_another_model_is_refused(saved_run, tmp_path):
    result = run(train_command("python", 1, "--model", "mlp", "--max_steps", 6, "--output_dir", saved_run,
                               "--resume", "auto"))
    _fails(result, "was made with model='cnn' but this run has model='mlp'")


def test_resume_auto_without_checkpoints_starts_fresh(tmp_path):
    result = train("python", 1, "--max_steps", 2, "--output_dir", tmp_path / "new", "--resume", "auto")
    assert "no complete checkpoint" in result.stdout and "starting fresh" in result.stdout
    manifest = json.loads((tmp_path / "new" / "checkpoints" / "step00000002" / "manifest.json").read_text())
    assert {"mp_rank_00_model_states.pt", "trainer_state.json", "rng_rank00000.json"} <= set(manifest)
