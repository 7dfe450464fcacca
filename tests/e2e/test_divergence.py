"""A run that diverges stops and loses nothing (app/core/divergence.py), on 2 ranks under ZeRO 0-3, bf16 weights,
offload, pipeline stages and LoRA: with a learning rate that diverges, with one step of NaN gradients injected from
outside the app (tests/helpers/nan_grads.py) and with NaN gradients from a step on."""
import json
import math

import pytest

from app.tools.instructions import write_model
from conftest import REPO, assert_one_error_line, read_metrics, read_summary, train_jobs, write_text_rows

LIMIT, LOG = 4, 2  # --max_nonfinite_steps, --log_interval


def _config(tmp_path, name: str, lr: float = None) -> tuple:
    """(label, path) of a ds_config for the cases: a shipped file, or bf16 weights at a ZeRO stage, lr changed."""
    base, _, stage = name.partition("-bf16-zero")
    ds = json.loads((REPO / "ds_configs" / f"{base}.json").read_text())
    if stage:
        ds.pop("torch_autocast")
        ds.update(bf16={"enabled": True}, zero_optimization={"stage": int(stage)})
    if lr is not None:
        ds["optimizer"]["params"]["lr"] = lr
    path = tmp_path / f"{name}-{lr}.json"
    path.write_text(json.dumps(ds))
    return path


CONFIGS = ("dp", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "pipeline", "dp-bf16-zero0",
           "dp-bf16-zero2")
SKIPPING = ("zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "dp-bf16-zero0", "dp-bf16-zero2")
"""The configs whose optimizer skips a step with a gradient norm that is not finite (ZeRO 0 in fp32 applies it)."""


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora")
    return write_model(folder, seed=0, layers=1), write_text_rows(folder / "corpus.txt", 300)


def _jobs(tmp_path, lora_model, steps: int, lr: float = None) -> dict:
    """label -> argv of a job per config, and LoRA on a one-layer Llama under ZeRO-3."""
    common = ["--max_steps", steps, "--log_interval", LOG, "--save_interval", LOG, "--keep_last", 2,
              "--max_nonfinite_steps", LIMIT, "--eval_interval", steps]
    jobs = {name: ["--deepspeed_config", _config(tmp_path, name, lr), *common, "--output_dir", tmp_path / name]
            for name in CONFIGS}
    model, corpus = lora_model
    jobs["zero3-lora"] = ["--deepspeed_config", _config(tmp_path, "zero3", lr), "--model", model, "--dataset", corpus,
                          "--lora", "--block_size", 32, *common, "--output_dir", tmp_path / "zero3-lora"]
    return jobs


def _finite_checkpoints(output_dir) -> list:
    """The steps of the complete checkpoints a run left, each checked to hold finite weights only."""
    from app.checkpoint.save import checkpoint_root, complete_checkpoints
    from app.tools.export import fp32_state_dict
    found = complete_checkpoints(checkpoint_root(output_dir))
    for folder in found:
        state = fp32_state_dict(folder)
        assert all(bool(t.isfinite().all()) for t in state.values()), f"{folder} holds weights that are not finite"
    return [int(folder.name.removeprefix("step")) for folder in found]


def _ended(output: str) -> int:
    """The step a diverged run ended at, from rank 0's one line (which says since when, and what to try)."""
    line = assert_one_error_line(output, "the run diverged", "lower the learning rate", "--resume auto")
    return int(line.split("(now step ")[1].split(";")[0])


def test_a_learning_rate_that_diverges_ends_the_run_in_one_line_and_keeps_only_finite_checkpoints(tmp_path,
                                                                                                   lora_model):
    jobs = _jobs(tmp_path, lora_model, 40, lr=1e6)
    outputs = train_jobs("ranks", 2, list(jobs.values()), codes=[2] * len(jobs))
    for (name, argv), output in zip(jobs.items(), outputs):
        ended = _ended(output)
        assert ended <= 20, f"{name} ran on to step {ended}"
        kept = _finite_checkpoints(tmp_path / name)
        assert all(step < ended for step in kept), (name, kept, ended)


def test_one_step_of_nan_gradients_is_skipped_counted_and_said(tmp_path, lora_model):
    """Step 3's gradients are NaN: the configs that skip such a step train on and count it (metrics.csv, summary.json,
    the log line), the learning-rate schedule held back as DeepSpeed holds it; ZeRO 0 in fp32 applies it, as
    DeepSpeed does, and its weights are lost: it ends in one line, its checkpoints from before kept."""
    jobs = _jobs(tmp_path, lora_model, 12)
    skipping = [name for name in jobs if name in SKIPPING or name.endswith("lora")]
    outputs = train_jobs("ranks", 2, list(jobs.values()), codes=[0 if n in skipping else 2 for n in jobs],
                         wrapper=("tests/helpers/nan_grads.py", 3, 3))
    for name, output in zip(jobs, outputs):
        if name not in skipping:
            assert _ended(output) <= 3 + LIMIT + LOG, name
            assert _finite_checkpoints(tmp_path / name) == [2], name
            continue
        assert read_summary(tmp_path / name)["skipped_steps"] == 1, name
        rows, _ = read_metrics(tmp_path / name)
        assert [r["skipped_steps"] for r in rows] == [0, 1, 1, 1, 1, 1], (name, rows)
        assert all(math.isfinite(r["loss"]) for r in rows if r["step"] != 4), (name, rows)
        assert "skipped_steps 1" in output, name
        assert _finite_checkpoints(tmp_path / name) == [10, 12], name


def test_nan_gradients_from_a_step_on_end_the_run_in_one_line_and_the_last_good_checkpoint_resumes(tmp_path,
                                                                                                     lora_model):
    jobs = _jobs(tmp_path, lora_model, 30)
    outputs = train_jobs("ranks", 2, list(jobs.values()), codes=[2] * len(jobs),
                         wrapper=("tests/helpers/nan_grads.py", 5, 0))
    for name, output in zip(jobs, outputs):
        ended = _ended(output)
        if name in SKIPPING or name.endswith("lora"):  # the weights stay finite: the limit ends it
            assert 5 + LIMIT - 1 <= ended <= 5 + LIMIT + LOG, (name, ended)
        else:  # ZeRO 0 in fp32 applies the NaN step: the next save finds its weights are not finite
            assert ended == 6 and "its weights are not finite" in output, (name, ended)
        assert "since step 5" in output, (name, output[-2000:])
        kept = _finite_checkpoints(tmp_path / name)
        assert kept and max(kept) >= 4, (name, kept)
    # once the cause is gone, --resume auto continues from the newest checkpoint, whose weights are the last good ones
    for name in ("dp", "zero3"):
        train_jobs("ranks", 2, [[*jobs[name], "--resume", "auto"]])
        rows, _ = read_metrics(tmp_path / name)
        assert [r["step"] for r in rows] == list(range(LOG, 31, LOG)) and all(math.isfinite(r["loss"]) for r in rows)
        assert read_summary(tmp_path / name)["steps"] == 30
