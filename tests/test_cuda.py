"""The CUDA paths, run when the machine has a GPU: auto device, auto precision, every ZeRO stage, compile, NCCL."""
import functools
import subprocess
import sys

import pytest

from conftest import REPO, cuda_env, read_metrics, read_summary, train

pytestmark = pytest.mark.slow  # a subprocess asks for the GPUs; the tests train on them through app/train.py


@functools.lru_cache(maxsize=1)
def gpus() -> int:
    """CUDA devices the machine has (the rest of the suite hides them), asked of a fresh interpreter."""
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                           capture_output=True, text=True, env=cuda_env(), timeout=120)
    return int(probe.stdout.strip() or 0) if probe.returncode == 0 else 0


def need(count: int):
    if gpus() < count:
        pytest.skip(f"needs {count} CUDA device(s); this machine has {gpus()}")


def gpu_train(out, *args, launcher="python", nproc=1):
    return train(launcher, nproc, "--max_steps", 12, "--log_interval", 1, "--output_dir", out, *args,
                 base_env=cuda_env())


def test_one_gpu_auto_mode_compiles_and_picks_bf16(tmp_path):
    need(1)
    result = gpu_train(tmp_path / "run")
    assert "mode: no launcher and one GPU: plain single-device training on cuda:0" in result.stdout
    assert 'precision: bf16 (bf16 "auto": the CUDA device supports bf16)' in result.stdout
    assert "compile: compiling the model and its loss" in result.stdout and "could not be compiled" not in result.stdout
    summary = read_summary(tmp_path / "run")
    assert summary["precision"] == "bfloat16" and summary["peak_memory_bytes"] > 0
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")[0]]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("name", ["dp", "zero1", "zero2", "zero3", "zero2_offload"])
def test_every_zero_stage_trains_in_bf16_on_one_gpu(name, tmp_path):
    need(1)
    gpu_train(tmp_path / "run", "--deepspeed_config", REPO / "ds_configs" / f"{name}.json", "--model", "gpt2-tiny",
              "--dataset", _corpus(tmp_path))
    summary = read_summary(tmp_path / "run")
    assert summary["precision"] == "bfloat16" and 0 < summary["mfu"] < 1
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")[0]]
    assert losses[-1] < losses[0]


def test_fp32_on_cuda_uses_tf32_unless_turned_off(tmp_path):
    need(1)
    fp32 = tmp_path / "fp32.json"
    fp32.write_text((REPO / "ds_configs" / "dp.json").read_text().replace('"auto"', "false"))
    on = gpu_train(tmp_path / "on", "--deepspeed_config", fp32, "--compile", "off")
    off = gpu_train(tmp_path / "off", "--deepspeed_config", fp32, "--compile", "off", "--tf32", "off")
    assert "precision: float32; TF32 matmuls" in on.stdout
    assert "precision: float32; full-fp32 matmuls (--tf32 off)" in off.stdout


def test_two_ranks_with_nccl(tmp_path):
    need(2)
    result = gpu_train(tmp_path / "run", "--deepspeed_config", REPO / "ds_configs" / "zero2.json",
                       launcher="deepspeed", nproc=2)
    assert "nccl on cuda" in result.stdout and read_summary(tmp_path / "run")["world_size"] == 2


def _corpus(tmp_path):
    from conftest import write_text_rows
    return write_text_rows(tmp_path / "corpus.txt", 600)


def test_a_one_stage_pipeline_trains_in_bf16_on_one_gpu(tmp_path):
    """DeepSpeed's pipeline engine on CUDA (one GPU holds one stage): bf16, the tied GPT-2 split, eval."""
    need(1)
    from conftest import config_variant
    config = config_variant(tmp_path, "pipeline", pipeline={"stages": 1})
    result = gpu_train(tmp_path / "run", "--deepspeed_config", config, "--model", "gpt2-tiny",
                       "--dataset", _corpus(tmp_path))
    assert "pipeline: 1 stage x 1 data-parallel replica(s)" in result.stdout
    assert "compile: pipeline stages run eager" in result.stdout
    summary = read_summary(tmp_path / "run")
    assert summary["precision"] == "bfloat16" and summary["pipeline_stages"] == 1
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")[0]]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("name, model", [("pipeline", "gpt2-tiny"), ("tensor_parallel", "llama-tiny")])
def test_model_parallel_configs_on_two_gpus_with_nccl(name, model, tmp_path):
    need(2)
    result = gpu_train(tmp_path / "run", "--deepspeed_config", REPO / "ds_configs" / f"{name}.json", "--model", model,
                       "--dataset", _corpus(tmp_path), launcher="deepspeed", nproc=2)
    assert "nccl on cuda" in result.stdout
    summary = read_summary(tmp_path / "run")
    assert summary["world_size"] == 2 and summary["precision"] == "bfloat16"
    assert summary["pipeline_stages" if name == "pipeline" else "tensor_parallel_size"] == 2
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")[0]]
    assert losses[-1] < losses[0]
