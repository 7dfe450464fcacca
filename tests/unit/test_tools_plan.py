"""The plan command (python -m app.tools.plan): memory sizes, its table, its recommendation and its one-line
mistakes. The estimate it prints: test_estimate.py."""
import pytest

from app.tools import plan as plan_tool

@pytest.mark.parametrize("text, count", [("80GB", 80e9), ("80GiB", 80 * 2**30), ("81920MiB", 80 * 2**30),
                                         ("24", 24e9), (" 1.5 TB ", 1.5e12)])
def test_memory_sizes(text, count):
    assert plan_tool.memory_size(text) == int(count)


@pytest.mark.parametrize("argv, message", [
    (["--gpu_memory", "lots"], "--gpu_memory 'lots' is not a memory size; write it like 80GB"),
    (["--gpu_memory", "0GB"], "is not a memory size"),
    ([], "no GPU here to read the memory of: pass --gpu_memory"),
    (["--gpu_memory", "8GB", "--model", "nope-9000"], "unknown model 'nope-9000'"),
])
def test_mistakes_are_one_line(argv, message, capsys):
    assert plan_tool.main(argv) == 2  # the CPU tests see no GPU (conftest hides them)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_a_config_only_folder_plans_and_the_fastest_config_that_fits_is_recommended(tmp_path, capsys):
    from app.core import models
    models.hf_spec("gpt2-tiny").config.save_pretrained(tmp_path / "gpt2")  # config.json, no weights
    assert plan_tool.main(["--model", str(tmp_path / "gpt2"), "--world_size", "2", "--micro_batch", "64",
                           "--seq_len", "128", "--gpu_memory", "1.4GB"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:] if line.split()[0] in plan_tool.ORDER}
    assert list(rows) == list(plan_tool.ORDER), "every shipped data-parallel config, fastest first"
    assert rows["dp"][-3] == "no" and rows["activation_checkpointing"][-3] == "yes", out
    assert "recommended: activation_checkpointing" in out and "dp would peak at" in out
    assert "dp+bf16 would peak at" in out and "not planned: bf16" in out


def test_each_autocast_config_is_also_planned_with_bf16_weights_which_win_where_only_they_fit(tmp_path, capsys):
    """bf16 weights hold half the weights and gradients of autocast's fp32 ones: on a GPU where dp under autocast
    does not fit and dp with bf16 weights does, the plan recommends that (autocast first at the same config)."""
    from app.core import models
    models.hf_spec("gpt2-tiny").config.save_pretrained(tmp_path / "gpt2")
    argv = ["--model", str(tmp_path / "gpt2"), "--world_size", "2", "--micro_batch", "64", "--seq_len", "128",
            "--deepspeed_config", str(plan_tool.ds_config.REPO / "ds_configs" / "dp.json")]
    assert plan_tool.main([*argv, "--gpu_memory", "10GB"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:4]}
    autocast, bf16 = rows[argv[-1]], rows[argv[-1] + "+bf16"]
    assert float(bf16[1]) == pytest.approx(float(autocast[1]) / 2, abs=0.01), "weights: 2 bytes, not 4"
    peaks = float(autocast[9]), float(bf16[9])
    assert peaks[1] < peaks[0] and f"recommended: {argv[-1]}," in out, "both fit: autocast, the more precise"
    memory = sum(peaks) / 2 / 0.92  # a run may use 92% of it: between the two peaks
    assert plan_tool.main([*argv, "--gpu_memory", f"{memory:.4f}GB"]) == 0
    out = capsys.readouterr().out
    assert f"recommended: {argv[-1]}+bf16" in out and "with bf16 weights in place of autocast's fp32 ones" in out
    assert f"({argv[-1]} would peak at" in out
