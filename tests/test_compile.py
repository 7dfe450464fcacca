"""torch.compile through the engine on CPU (inductor): every ZeRO stage, the same losses as one process, exact resume."""
import pytest

from test_checkpoint import assert_same_run
from test_train import STAGES, assert_two_ranks_match, one_process_reference, two_rank_runs
from conftest import REPO, run, train, train_command

pytestmark = pytest.mark.slow  # every test trains through app/train.py in a subprocess or a launcher

COMPILE = ["--compile", "on"]
COMPILING = "compile: compiling the model and its loss with torch.compile"


@pytest.fixture(scope="module")
def compiled_one_process(tmp_path_factory):
    return one_process_reference(tmp_path_factory.mktemp("compiled-one"), *COMPILE)


@pytest.fixture(scope="module")
def compiled_two_ranks(tmp_path_factory):
    return two_rank_runs(tmp_path_factory.mktemp("compiled-two"), *COMPILE)


@pytest.mark.parametrize("name", STAGES)
def test_compiled_two_ranks_compute_what_one_process_does(name, compiled_one_process, compiled_two_ranks):
    """Compiled, 2 ranks x micro batch 4 under each ZeRO stage == 1 compiled process x micro batch 8."""
    losses, stdout = compiled_two_ranks[name]
    assert_two_ranks_match(compiled_one_process, losses)
    assert stdout.count(COMPILING) == 1, "rank 0 says once that it compiles"
    assert "could not be compiled" not in stdout


def test_compiled_run_killed_and_resumed_is_exact(tmp_path):
    """A compiled run killed after its step-5 save resumes to the same losses and weights as an unbroken one."""
    args = ["--deepspeed_config", REPO / "ds_configs" / "zero1.json", *COMPILE, "--max_steps", 10,
            "--log_interval", 1, "--save_interval", 5]
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    train("python", 1, *args, "--output_dir", whole)
    killed = run(train_command("python", 1, *args, "--output_dir", broken), APP_KILL_AT="shards:10")
    assert killed.returncode != 0
    result = train("python", 1, *args, "--output_dir", broken, "--resume", "auto")
    assert "at step 5" in result.stdout and COMPILING in result.stdout
    assert_same_run(whole, broken, steps=10)


def test_auto_on_cpu_runs_eager(one_process_run):
    """--compile auto compiles only for CUDA devices: on this CPU the run is eager and says nothing of it."""
    _, stdout = one_process_run
    assert "compile:" not in stdout
