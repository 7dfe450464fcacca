"""Automatic restarts after a crash: torchrun --max_restarts and app.tools.restart (for the deepspeed launcher) run
a killed run again with --resume auto, and it finishes as if it had never been killed."""
import re
import sys


from conftest import BIN, FAULTS, REPO, TWO_RANK_ARGS, free_port, run
from e2e.test_checkpoint import assert_same_run


def test_torchrun_max_restarts_resumes_a_killed_run_exactly(tmp_path, two_rank_run):
    """Rank 1 is killed while writing the step-10 checkpoint; torchrun starts both ranks again, which continue
    from step 5, the last whole checkpoint, to the losses and weights of the run that was never killed."""
    out = tmp_path / "run"
    result = run([str(BIN / "torchrun"), "--nproc_per_node", "2", "--max_restarts", "1", "--master_port",
                  str(free_port()), FAULTS, "app/train.py", "--deepspeed_config", str(REPO / "ds_configs" / "dp.json"),
                  *map(str, TWO_RANK_ARGS), "--output_dir", str(out), "--resume", "auto"], APP_KILL_AT="shards:10:1",
                 APP_PATIENCE_S="1")  # the rank left alone waits 1 s for the dead one, not 5
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resume: " in result.stdout and "at step 5" in result.stdout
    assert_same_run(two_rank_run("dp")[0], out)


def test_the_restart_tool_does_it_for_the_deepspeed_launcher(tmp_path, two_rank_run):
    out = tmp_path / "run"
    command = [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), FAULTS, "app/train.py",
               "--deepspeed_config", str(REPO / "ds_configs" / "zero1.json"), *map(str, TWO_RANK_ARGS),
               "--output_dir", str(out)]
    result = run([sys.executable, "-m", "app.tools.restart", "--max_restarts", "1", "--wait", "1", "--", *command],
                 APP_KILL_AT="manifest:10:0", APP_PATIENCE_S="1")  # every shard of step 10 written, rank 0 dies
    # before the manifest; the rank left alone waits 1 s for the dead one, not 5
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"restart: the run exited with \d+; running it again from its last checkpoint \(1 of 1 restarts\)",
                     result.stdout), result.stdout[-3000:]
    assert "at step 5" in result.stdout
    assert_same_run(two_rank_run("zero1")[0], out)
