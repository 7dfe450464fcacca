"""The GRPO benchmark run for real: the app's GRPO under ZeRO-3, sampled gathered whole and layer by layer, beside
HF generate on the plain model; every figure measured and the ratios from them."""
import json
import sys

from conftest import run


def test_grpo_sampling_gathered_layered_and_hf_generate_are_measured(tmp_path):
    out = tmp_path / "bench"
    result = run([sys.executable, "-m", "app.tools.bench_grpo", "--model", "llama-tiny", "--prompts", 2,
                  "--prompt_len", 12, "--num_generations", 2, "--max_completion_length", 8, "--steps", 2,
                  "--output_dir", out])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    for mode in ("gathered", "layered"):
        row = report[mode]
        assert row["steps"] == 2 and 0 < row["mean_length"] <= 8 and row["tokens_per_s"] > 0
        assert 0 < row["sampling_share"] < 1, "sampling is part of the step, not all of it"
        assert row["over_hf_generate"] == row["tokens_per_s"] / report["hf_generate"]["tokens_per_s"]
        summary = json.loads((out / mode / "summary.json").read_text())
        assert summary["zero_stage"] == 3 and summary["task"] == "grpo"
    assert "headline gathered / HF generate: " in result.stdout and "headline layered / HF generate: " in result.stdout
