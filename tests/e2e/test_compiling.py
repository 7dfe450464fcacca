"""torch.compile through the engine on CPU (inductor): every ZeRO stage, the same losses as one eager process, exact
resume."""
import pytest

from e2e.test_checkpoint import assert_same_run
from e2e.test_train import STAGES, assert_two_ranks_match, one_process_reference
from conftest import (FAULTS, assert_one_error_line, config_variant, faulty_command, read_metrics, run, train,
                      train_jobs)


COMPILE = ["--compile", "on"]
COMPILING = "compile: compiling the model and its loss with torch.compile"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: one eager process with micro batch 8. The compiled runs match it within the equivalence
    tests' tolerance (they differ by about 3e-7): compiling changes how the sums are ordered, not what they are."""
    return one_process_reference(tmp_path_factory.mktemp("one"))


# Runs that fail on purpose, in the same launch (tests/helpers/faults.py): inductor refuses rank 1's backward graph,
# or every rank's forward graph; rank 1 runs out of memory in its first compiled step.
FAULT_RUNS = {"backward-on-rank-1": ("zero2", {"APP_FAIL_COMPILE": "backward:1"}, 0),
          "forward-everywhere": ("dp", {"APP_FAIL_COMPILE": "forward"}, 0),
          "oom-on-rank-1": ("dp", {"APP_OOM_AT": "4:1"}, 2)}


@pytest.fixture(scope="module")
def compiled_two_ranks(tmp_path_factory):
    """name -> (per-step losses, output) of 2 compiled ranks x micro batch 4, 12 steps, under each ZeRO stage
    and each fault of FAULTS, one after another in one launch."""
    tmp = tmp_path_factory.mktemp("compiled-two")
    runs = {**{name: (name, {}, 0) for name in STAGES}, **FAULT_RUNS}
    jobs = [{"argv": ["--deepspeed_config", config_variant(tmp, config, train_micro_batch_size_per_gpu=4),
                      "--max_steps", 12, "--log_interval", 1, "--output_dir", tmp / name, *COMPILE], "env": env}
            for name, (config, env, _) in runs.items()]
    outputs = train_jobs("ranks", 2, jobs, codes=[code for _, _, code in runs.values()], wrapper=(FAULTS,))
    return {name: ([r["loss"] for r in read_metrics(tmp / name)[0]] if code == 0 else [], out)
            for (name, (_, _, code)), out in zip(runs.items(), outputs)}


@pytest.mark.parametrize("name", STAGES)
def test_compiled_two_ranks_compute_what_one_process_does(name, one_process, compiled_two_ranks):
    """Compiled, 2 ranks x micro batch 4 under each ZeRO stage == 1 eager process x micro batch 8."""
    losses, stdout = compiled_two_ranks[name]
    assert_two_ranks_match(one_process, losses)
    assert stdout.count(COMPILING) == 1, "rank 0 says once that it compiles"
    assert "could not be compiled" not in stdout


def test_compiled_run_killed_and_resumed_is_exact(tmp_path):
    """A compiled run killed after its step-5 save resumes to the same losses and weights as an unbroken one
    (ZeRO-1, micro batch 4 on one thread: inductor's CPU kernels depend on the shapes and the thread count, so these
    are the kernels it built for compiled_two_ranks' ranks)."""
    args = ["--deepspeed_config", config_variant(tmp_path, "zero1", train_micro_batch_size_per_gpu=4), *COMPILE,
            "--max_steps", 10, "--log_interval", 1, "--save_interval", 5]
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    train("python", 1, *args, "--output_dir", whole, OMP_NUM_THREADS="1")
    killed = run(faulty_command("python", 1, *args, "--output_dir", broken), APP_KILL_AT="shards:10",
                 OMP_NUM_THREADS="1")
    assert killed.returncode != 0
    result = train("python", 1, *args, "--output_dir", broken, "--resume", "auto", OMP_NUM_THREADS="1")
    assert "at step 5" in result.stdout and COMPILING in result.stdout
    assert_same_run(whole, broken, steps=10)


def test_auto_on_cpu_runs_eager(one_process_run):
    """--compile auto compiles only for CUDA devices: on this CPU the run is eager and says nothing of it."""
    _, stdout = one_process_run
    assert "compile:" not in stdout


@pytest.mark.parametrize("fault, ranks", [("backward-on-rank-1", "1"), ("forward-everywhere", "0,1")])
def test_a_graph_the_compiler_refuses_sends_every_rank_eager(fault, ranks, one_process, compiled_two_ranks):
    """The first step compiles the backward with the forward, every rank hears how it went on each rank, and all
    redo that step eager together (under ZeRO 2, gradients from a compiled backward on one rank and an eager one
    on another would be reduced in different orders, and mixed), to the same losses as one process."""
    losses, output = compiled_two_ranks[fault]
    said = [line for line in output.splitlines() if "could not be compiled" in line]
    assert len(said) == 1 and f"could not be compiled on rank {ranks} (" in said[0], output[-2000:]
    assert "APP_FAIL_COMPILE" in said[0] and said[0].endswith("every rank runs eager")
    assert "Traceback" not in output
    assert_two_ranks_match(one_process, losses)


def test_out_of_memory_in_the_first_compiled_step_is_said_as_itself(compiled_two_ranks):
    """Not 'could not be compiled': every rank ends, and rank 0 says which rank ran out of memory."""
    _, output = compiled_two_ranks["oom-on-rank-1"]
    assert "could not be compiled" not in output
    line = assert_one_error_line(output, "the first training step failed on rank 1: out of memory",
                                 "lower train_micro_batch_size_per_gpu")
    assert "APP_OOM_AT=4:1" in line
