"""The packing benchmark's parts: each mode's training command and launcher, the rates it reads, its flags."""
import stat
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from app.tools import bench_packing

ARGS = Namespace(model="runs/opposites/model", dataset="runs/opposites/chats.jsonl", steps=7,
                 output_dir="runs/bench-packing")


def _flag(command: list, name: str) -> str:
    return command[command.index(name) + 1]


@pytest.mark.parametrize("mode, packing", [("padded", "off"), ("packed", "on")])
def test_each_mode_trains_the_same_model_and_data_with_its_own_packing_and_folder(mode, packing):
    command = bench_packing.command("", mode, ARGS, ["--deepspeed_config", "ds_configs/zero2.json"])
    assert command[:2] == [sys.executable, str(bench_packing.REPO / "app" / "train.py")]
    assert (_flag(command, "--model"), _flag(command, "--dataset")) == (ARGS.model, ARGS.dataset)
    assert _flag(command, "--packing") == packing
    assert _flag(command, "--output_dir") == str(Path("runs/bench-packing") / mode)
    assert _flag(command, "--max_steps") == "7" and _flag(command, "--log_interval") == "1", "a row a step"
    assert _flag(command, "--eval_answers") == "0" and "--overwrite" in command
    assert command[-2:] == ["--deepspeed_config", "ds_configs/zero2.json"], "the flags after -- come last and win"


def test_a_launcher_of_this_environment_is_found_beside_its_python_when_not_on_the_path(tmp_path, monkeypatch):
    own = tmp_path / "mylauncher"
    own.write_text("#!/bin/sh\n")
    own.chmod(own.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(tmp_path))
    beside = Path(sys.executable).parent / "deepspeed"
    assert beside.is_file(), "the virtual environment's deepspeed launcher"
    command = bench_packing.command("deepspeed --num_gpus 2", "packed", ARGS, [])
    assert command[:4] == [str(beside), "--num_gpus", "2", str(bench_packing.REPO / "app" / "train.py")]
    assert bench_packing.command("mylauncher -n 2", "packed", ARGS, [])[:3] == ["mylauncher", "-n", "2"]
    assert bench_packing.command("nosuchlauncher", "packed", ARGS, [])[0] == "nosuchlauncher", \
        "left as typed, so its own error names it"


def test_the_rates_of_a_run_leave_its_first_step_out():
    """The first step compiles and warms up, and more for one shape than the other: the median of the rest, times
    the rows and real tokens a sample holds (summary.json's ratios)."""
    summary = {"samples_per_s": 12.5, "rows_per_s": 50.0, "real_tokens_per_s": 3200.0, "train_s": 2.4, "steps": 4,
               "final_loss": 1.2, "zero_stage": 2}
    rows = [{"step": 1, "samples_per_s": 0.5}, {"step": 2, "samples_per_s": 20.0}, {"step": 3, "samples_per_s": 22.0},
            {"step": 4, "samples_per_s": 18.0}]
    assert bench_packing.rates(summary, rows) == {"samples_per_s": 20.0, "rows_per_s": 80.0,
                                                  "real_tokens_per_s": 5120.0, "train_s": 2.4, "steps": 3}


@pytest.mark.parametrize("argv, message", [
    ([], "the following arguments are required: --model, --dataset"),
    (["--model", "m", "--dataset", "d", "--steps", "many"], "--steps: invalid int value: 'many'"),
    (["--model", "m", "--dataset", "d", "--steps", "1"], "--steps must be at least 2"),
])
def test_a_missing_or_bad_flag_is_one_error_line_before_any_run(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as caught:
        bench_packing.main([*argv, "--output_dir", str(tmp_path / "out")])
    assert caught.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], errors
    assert not (tmp_path / "out").exists()
