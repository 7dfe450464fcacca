"""End-to-end runs of app/train.py through every launch mode and every file in ds_configs/."""
import json
import os
from pathlib import Path

import pytest

from conftest import (REPO, assert_one_error_line, config_variant, read_metrics, read_summary, run, train,
                      train_command, train_jobs, two_rank_steps)
from unit.test_train import CONFIGS, STAGE


@pytest.mark.parametrize("name", CONFIGS)
def test_config_trains_with_two_ranks(name, two_rank_run):
    """Every ds_config trains the digits CNN with 2 gloo ranks (the deepspeed launcher itself: test_launchers.py)."""
    out, stdout = two_rank_run(name)
    train_rows, eval_rows = read_metrics(out)
    summary = read_summary(out)
    assert summary["world_size"] == 2 and summary["zero_stage"] == STAGE[name]
    assert summary["precision"] == ("bfloat16" if "bf16" in name else "float32")
    steps = two_rank_steps(name)
    assert summary["steps"] == steps and summary["pipeline_stages"] == (2 if name == "pipeline" else 0)
    assert len(eval_rows) == 2, "one evaluation per epoch"
    assert [r["step"] for r in train_rows] == list(range(1, steps + 1))
    assert train_rows[-1]["loss"] < 0.6 * train_rows[0]["loss"], "the loss falls"
    assert eval_rows[-1]["eval_loss"] < eval_rows[0]["eval_loss"], "the held-out loss falls from epoch to epoch"
    assert summary["eval_accuracy"] > 0.8, f"held-out accuracy rises from chance (0.1): {summary}"
    assert summary["samples_per_s"] > 0 and summary["peak_memory_bytes"] > 0 and summary["wall_s"] > 0
    assert summary["host_peak_bytes"] >= summary["peak_memory_bytes"], "on a CPU both are the resident set"
    assert all(r["samples_per_s"] > 0 for r in train_rows)
    assert all(r["lr"] > 0 for r in train_rows[1:]), "the linear warm-up starts from 0 at step 1"
    assert (out / "loss.png").stat().st_size > 1000
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    # only rank 0 prints: the mode line and every metrics line appear once
    assert stdout.count("mode: started by deepspeed") == 1
    assert stdout.count("step 5 epoch 0 loss") == 1
    # DeepSpeed's CPU backend leaves a 69 MB /dev/shm segment per rank behind unless the app removes it
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*"))


def test_python_without_launcher_uses_one_cpu_process(one_process_run):
    out, stdout = one_process_run
    assert "mode: no launcher and no GPU: one CPU process with gloo" in stdout
    assert read_summary(out)["world_size"] == 1
    train_rows, eval_rows = read_metrics(out)
    assert [r["step"] for r in train_rows] == [2, 4, 6] and len(eval_rows) == 1


def test_torchrun_two_processes(tmp_path):
    out = tmp_path / "run"
    result = train("torchrun", 2, "--deepspeed_config", REPO / "ds_configs" / "zero1.json", "--max_steps", 10,
                   "--output_dir", out)
    assert result.stdout.count("mode: started by torchrun; 2 rank(s)") == 1
    summary = read_summary(out)
    assert summary["world_size"] == 2 and summary["launcher"] == "torchrun" and summary["steps"] == 10


def losses(launcher, nproc, config, out, *extra) -> tuple:
    """(per-step losses, stdout) of a 12-step run logging every step."""
    result = train(launcher, nproc, "--deepspeed_config", config, "--max_steps", 12, "--log_interval", 1,
                   "--output_dir", out, *extra)
    return [r["loss"] for r in read_metrics(out)[0]], result.stdout


def one_process_reference(tmp, *extra) -> list:
    """The reference: plain data parallel in one process with micro batch 8."""
    return losses("python", 1, config_variant(tmp, "dp", train_micro_batch_size_per_gpu=8), tmp / "run", *extra)[0]


STAGES = ["dp", "zero1", "zero2", "zero3"]


def equivalence_jobs(tmp) -> dict:
    """name -> the 12-step run of 2 ranks x micro batch 4 under each ZeRO stage's config."""
    tmp.mkdir(parents=True)
    return {name: ["--deepspeed_config", config_variant(tmp, name, train_micro_batch_size_per_gpu=4), "--max_steps",
                   12, "--log_interval", 1, "--output_dir", tmp / name] for name in STAGES}


@pytest.fixture(scope="module")
def two_rank(tmp_path_factory):
    """(group, name) -> (output_dir, stdout) of every 2-rank run of this file, one after another in one deepspeed
    launch: the equivalence runs, bf16 autocast's and the bf16 section's."""
    root = tmp_path_factory.mktemp("two")
    groups = {"equivalence": equivalence_jobs(root / "equivalence"), "autocast": autocast_jobs(root / "autocast"),
              "bf16": bf16_weight_jobs(root / "bf16")}
    tags = [(group, name) for group, jobs in groups.items() for name in jobs]
    outputs = train_jobs("ranks", 2, [groups[group][name] for group, name in tags])
    return {tag: (Path(groups[tag[0]][tag[1]][-1]), output) for tag, output in zip(tags, outputs)}


def two_rank_losses_of(two_rank, group: str, name: str) -> list:
    return [r["loss"] for r in read_metrics(two_rank[(group, name)][0])[0]]


def assert_two_ranks_match(one: list, two: list):
    """Two ranks' per-step losses equal one process's within 1e-5, and falling."""
    assert len(one) == len(two) == 12
    assert max(abs(a - b) for a, b in zip(one, two)) < 1e-5, list(zip(one, two))
    assert one[-1] < one[0]


@pytest.fixture(scope="module")
def one_process_losses(tmp_path_factory):
    return one_process_reference(tmp_path_factory.mktemp("one"))


@pytest.mark.parametrize("name", STAGES)
def test_two_ranks_compute_what_one_process_does(name, one_process_losses, two_rank):
    """Synchronous data parallelism: 2 ranks x micro batch 4 under each ZeRO stage == 1 process x micro batch 8."""
    assert_two_ranks_match(one_process_losses, two_rank_losses_of(two_rank, "equivalence", name))


def test_gradient_accumulation_counts_optimizer_steps(tmp_path):
    out = tmp_path / "run"
    config = config_variant(tmp_path, "dp", train_micro_batch_size_per_gpu=16, gradient_accumulation_steps=2)
    train("python", 1, "--deepspeed_config", config, "--max_steps", 4, "--log_interval", 1, "--output_dir", out)
    rows = read_metrics(out)[0]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert json.loads((out / "summary.json").read_text())["samples"] == 4 * 32


def test_a_profile_of_three_steps_is_written_and_reads_as_a_chrome_trace(tmp_path):
    """--profile 2:4 on a CPU run: rank 0's trace of those steps, which Perfetto and TensorBoard read, and the run
    says where it is. Step 4's evaluation is in it: the CNN ran more forwards than backwards."""
    out = tmp_path / "run"
    result = train("python", 1, "--max_steps", 5, "--log_interval", 1, "--eval_interval", 4, "--profile", "2:4",
                   "--output_dir", out)
    trace = out / "profile" / "rank0.steps2-4.pt.trace.json"
    assert f"profile: steps 2-4 written to {trace}" in result.stdout
    names = [e.get("name") for e in json.loads(trace.read_text())["traceEvents"]]
    forwards, backwards = names.count("aten::convolution"), names.count("aten::convolution_backward")
    assert backwards and forwards > backwards, (forwards, backwards)
    refused = run(train_command("python", 1, "--max_steps", 4, "--profile", "3:9", "--output_dir", tmp_path / "x"))
    assert refused.returncode == 2
    assert_one_error_line(refused.stdout + refused.stderr, "--profile 3:9: the run takes 4 optimizer steps")


def autocast_jobs(tmp) -> dict:
    """name -> 6 steps of 2 ranks under each ZeRO stage with bf16 autocast on."""
    autocast = {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    for name in STAGES:
        (tmp / name).mkdir(parents=True)
    return {name: ["--deepspeed_config", config_variant(tmp / name, name, torch_autocast=autocast), "--max_steps", 6,
                   "--log_interval", 1, "--output_dir", tmp / name / "run"] for name in STAGES}


def test_under_bf16_autocast_every_zero_stage_reduces_gradients_in_fp32(two_rank):
    """The shipped configs' "lower_precision_safe_modules": [] keeps DeepSpeed's torch_autocast from reducing
    Linear and Conv gradients in bf16 under ZeRO 1-3 (ZeRO 0 reduces in fp32): with bf16 autocast on, 2 ranks
    train the same losses under every stage, as the raw loop's recipe does."""
    assert all("precision: bf16 autocast" in two_rank[("autocast", name)][1] for name in STAGES)
    losses = {name: two_rank_losses_of(two_rank, "autocast", name) for name in STAGES}
    for name in STAGES[1:]:
        assert losses[name] == pytest.approx(losses["dp"], abs=1e-6), (name, losses)


def bf16_weights(tmp, name: str, micro: int) -> Path:
    """ds_configs/<name>.json with DeepSpeed's bf16 section (16-bit weights) in place of autocast, and no schedule
    (a run cut in two follows the course of one run whole)."""
    ds = json.loads((REPO / "ds_configs" / f"{name}.json").read_text())
    ds = {k: v for k, v in ds.items() if k not in ("torch_autocast", "scheduler")}
    path = tmp / f"{name}-bf16-{micro}.json"
    path.write_text(json.dumps({**ds, "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": micro}))
    return path


def bf16_weight_jobs(tmp) -> dict:
    """name -> 6 steps of 2 ranks x micro 4 with the bf16 section under each ZeRO stage; for ZeRO 0 and 2, the
    same cut at step 3 ("<name>-cut") and resumed ("<name>-resumed")."""
    tmp.mkdir(parents=True)
    common = ["--log_interval", 1]
    jobs = {name: ["--deepspeed_config", bf16_weights(tmp, name, 4), "--max_steps", 6, *common, "--output_dir",
                   tmp / name] for name in STAGES}
    for name in ("dp", "zero2"):
        cut = ["--deepspeed_config", bf16_weights(tmp, name, 4), *common]
        jobs[f"{name}-cut"] = [*cut, "--max_steps", 3, "--output_dir", tmp / f"{name}-cut"]
        jobs[f"{name}-resumed"] = [*cut, "--max_steps", 6, "--resume", "auto", "--output_dir", tmp / f"{name}-cut"]
    return jobs


def test_bf16_weights_train_alike_on_one_and_two_ranks_and_resume_exactly(tmp_path, two_rank):
    """DeepSpeed's bf16 section, whose steps the app runs without a host sync (docs/gpu.md): 2 ranks x micro 4
    under every ZeRO stage against 1 process x micro 8 (losses of about 2.3), within bf16's rounding (8e-4 under
    ZeRO 0, 1.5e-2 under ZeRO 1-3 when measured); a run cut at step 3 and resumed gives the unbroken run's losses
    exactly."""
    outputs = [output for (group, _), (_, output) in two_rank.items() if group == "bf16"]
    assert all("precision: bf16" in output and "autocast" not in output for output in outputs), outputs[0]
    one = losses("python", 1, bf16_weights(tmp_path, "dp", 8), tmp_path / "one", "--max_steps", 6)[0]
    two = {name: two_rank_losses_of(two_rank, "bf16", name) for name in STAGES}
    for name in STAGES:  # ZeRO 1-3 reduce bf16 gradients in bf16 (DeepSpeed's default): more rounding than ZeRO 0
        worst = max(abs(a - b) for a, b in zip(one, two[name]))
        assert len(two[name]) == 6 and worst < (2e-3 if name == "dp" else 2e-2), (name, one, two[name])
    for name in ("dp", "zero2"):
        assert two_rank_losses_of(two_rank, "bf16", f"{name}-resumed") == two[name], name


def test_a_torchvision_classifier_starts_from_pretrained_weights(tmp_path):
    """--model_weights with a state-dict file: the run says what it loaded and what is new, and its first
    checkpoint's body is the file's weights moved by one step (lr 0: the file's own)."""
    import torch
    import torchvision
    torch.manual_seed(3)
    weights = torchvision.models.resnet18(num_classes=1000).state_dict()
    torch.save(weights, tmp_path / "resnet18.pth")
    config = config_variant(tmp_path, "dp", train_micro_batch_size_per_gpu=8,
                            optimizer={"type": "AdamW", "params": {"lr": 0.0, "weight_decay": 0.0}})
    out = tmp_path / "run"
    result = train("python", 1, "--model", "resnet18", "--model_weights", tmp_path / "resnet18.pth", "--dataset",
                   "synthetic", "--deepspeed_config", config, "--max_steps", 1, "--output_dir", out)
    assert "model weights: resnet18 from" in result.stdout and "new for the data's classes: fc.weight, fc.bias" in \
        result.stdout
    from app.tools import export
    exported = export.fp32_state_dict(next((out / "checkpoints").glob("step*")))
    assert torch.equal(exported["layer4.1.conv2.weight"], weights["layer4.1.conv2.weight"])
