"""Automatic restarts after a crash: torchrun --max_restarts and app.tools.restart (for the deepspeed launcher) run
a killed run again with --resume auto, and it finishes as if it had never been killed."""
import re
import sys

import pytest

from app.errors import UserError
from app.tools import restart
from conftest import BIN, REPO, TWO_RANK_ARGS, free_port, run
from test_checkpoint import assert_same_run


@pytest.mark.slow
def test_torchrun_max_restarts_resumes_a_killed_run_exactly(tmp_path, two_rank_run):
    """Rank 1 is killed while writing the step-10 checkpoint; torchrun starts both ranks again, which continue
    from step 5, the last whole checkpoint, to the losses and weights of the run that was never killed."""
    out = tmp_path / "run"
    result = run([str(BIN / "torchrun"), "--nproc_per_node", "2", "--max_restarts", "1", "--master_port",
                  str(free_port()), "app/train.py", "--deepspeed_config", str(REPO / "ds_configs" / "dp.json"),
                  *map(str, TWO_RANK_ARGS), "--output_dir", str(out), "--resume", "auto"], APP_KILL_AT="shards:10:1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resume: " in result.stdout and "at step 5" in result.stdout
    assert_same_run(two_rank_run("dp")[0], out)


@pytest.mark.slow
def test_the_restart_tool_does_it_for_the_deepspeed_launcher(tmp_path, two_rank_run):
    out = tmp_path / "run"
    command = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "app/train.py",
               "--deepspeed_config", str(REPO / "ds_configs" / "zero1.json"), *map(str, TWO_RANK_ARGS),
               "--output_dir", str(out)]
    result = run([sys.executable, "-m", "app.tools.restart", "--max_restarts", "1", "--wait", "1", "--", *command],
                 APP_KILL_AT="manifest:10:0")  # every shard of step 10 written, rank 0 dies before the manifest
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"restart: the run exited with \d+; running it again from its last checkpoint \(1 of 1 restarts\)",
                     result.stdout), result.stdout[-3000:]
    assert "at step 5" in result.stdout
    assert_same_run(two_rank_run("zero1")[0], out)


def test_the_restart_tool_adds_resume_auto_and_needs_an_output_dir():
    assert restart.parse(["--max_restarts", "2", "--", "deepspeed", "app/train.py", "--output_dir", "r"]) == \
        (2, 5.0, ["deepspeed", "app/train.py", "--output_dir", "r"])
    assert restart.with_resume(["x", "--resume", "runs/a/checkpoints/step00000005", "--output_dir", "r"]) == \
        ["x", "--output_dir", "r", "--resume", "auto"]
    assert restart.with_resume(["x", "--resume=auto"]) == ["x", "--resume", "auto"]
    with pytest.raises(UserError, match="needs --output_dir"):
        restart.parse(["--", "deepspeed", "app/train.py"])
    with pytest.raises(UserError, match="give the training command after --"):
        restart.parse(["--max_restarts", "1"])


def test_the_restart_tool_stops_at_success_a_user_error_or_its_last_restart(tmp_path):
    """Exit codes, each from a real command: 0 and 2 are final; a crash is run again, up to --max_restarts."""
    counter = tmp_path / "runs"
    script = f"import pathlib, sys; p = pathlib.Path({str(counter)!r}); p.write_text(p.read_text() + 'x') " \
             f"if p.exists() else p.write_text('x'); sys.exit(int(sys.argv[1]))"
    for code, runs in ((0, 1), (2, 1), (1, 3)):
        counter.unlink(missing_ok=True)
        assert restart.main(["--max_restarts", "2", "--wait", "0", "--", sys.executable, "-c", script, str(code),
                             "--output_dir", "x"]) == code
        assert len(counter.read_text()) == runs, code
