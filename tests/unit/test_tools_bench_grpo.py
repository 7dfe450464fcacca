"""The GRPO benchmark's parts: its inputs, each mode's command, the figures from a run's rows, and HF generate on
the plain model. The whole tool, run for real: tests/e2e/test_tools_bench_grpo.py."""
import json
from types import SimpleNamespace

import pytest

from app.tools import bench_grpo


def _args(tmp_path, **changed):
    return SimpleNamespace(**{"model": "llama-tiny", "prompts": 3, "prompt_len": 10, "num_generations": 4,
                              "max_completion_length": 8, "steps": 2, "launcher": "", "output_dir": str(tmp_path),
                              "deepspeed_config": str(bench_grpo.REPO / "ds_configs" / "zero3.json"), **changed})


def test_the_inputs_give_each_rank_one_micro_batch_of_prompts_of_the_asked_length(tmp_path):
    prompts, reward, ds = bench_grpo.write_inputs(tmp_path, _args(tmp_path))
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    assert len(rows) == 3 * 64 * 3 and {len(row["prompt"]) for row in rows} == {10}
    assert reward.endswith("rewards.py:zero")
    config = json.loads(ds.read_text())
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (3, 1)
    assert "train_batch_size" not in config and config["zero_optimization"]["stage"] == 3



def test_an_accelerate_file_gives_the_json_accelerate_builds_at_one_micro_batch(tmp_path):
    yaml_file = bench_grpo.REPO / "tests" / "data" / "accelerate" / "trl-deepspeed_zero3.yaml"
    _, _, ds = bench_grpo.write_inputs(tmp_path, _args(tmp_path, deepspeed_config=str(yaml_file)))
    config = json.loads(ds.read_text())
    assert config["zero_optimization"]["stage"] == 3 and config["bf16"] == {"enabled": True}
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (3, 1)


@pytest.mark.parametrize("text", [None, '{"zero_optimization": {"stage": 3,}}', "zero_stage: 3\n"])
def test_a_config_it_cannot_read_is_one_line_and_nothing_written(tmp_path, capsys, text):
    config = tmp_path / ("ds.yaml" if text and text.startswith("zero") else "ds.json")
    if text is not None:
        config.write_text(text)
    out = tmp_path / "out"
    assert bench_grpo.main(["--model", "llama-tiny", "--deepspeed_config", str(config), "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and str(config) in err[0] and not out.exists()

def test_each_mode_runs_grpo_gathered_or_layer_by_layer_logging_every_step(tmp_path):
    args = _args(tmp_path)
    inputs = bench_grpo.write_inputs(tmp_path / "in", args)
    gathered = bench_grpo.command(args, "gathered", inputs, ["--seed", "3"])
    assert gathered[1].endswith("app/train.py") and gathered[-2:] == ["--seed", "3"]
    flags = dict(zip(gathered[2::2], gathered[3::2]))
    assert flags["--gather_for_generation"] == "on" and flags["--max_steps"] == "3" and flags["--log_interval"] == "1"
    assert dict(zip(*[iter(bench_grpo.command(args, "layered", inputs, [])[2:])] * 2))["--gather_for_generation"] \
        == "off"


def test_the_figures_leave_the_first_step_out_and_count_a_ranks_tokens():
    rows = [{"step": 1, "sampling_s": 9.0, "completions/mean_length": 1.0, "samples_per_s": 0.1},
            {"step": 2, "sampling_s": 2.0, "completions/mean_length": 8.0, "samples_per_s": 1.5},
            {"step": 2, "eval_reward": 0.0},
            {"step": 3, "sampling_s": 2.0, "completions/mean_length": 6.0, "samples_per_s": 1.5}]
    found = bench_grpo.rates(rows, ranks=2, prompts=3, group=4)
    assert found["steps"] == 2 and found["mean_length"] == 7.0
    assert found["tokens_per_s"] == pytest.approx(3 * 4 * 7.0 / 2.0)
    assert found["step_s"] == pytest.approx(2 * 3 / 1.5) and found["sampling_share"] == pytest.approx(0.5)


def test_hf_generate_on_the_plain_model_samples_every_row_to_the_full_length():
    found = bench_grpo.plain_generate("llama-tiny", rows=2, prompt_len=5, new=4, repeats=1)
    assert found["tokens_per_s"] == pytest.approx(2 * 4 / found["sampling_s"]) and found["sampling_s"] > 0
