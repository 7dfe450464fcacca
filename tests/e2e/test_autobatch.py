"""The micro batch "auto": the largest that runs on every rank, found at start with real steps, the global batch
kept by gradient accumulation, the same losses as written by hand, kept across a resume; under ZeRO 0-3,
offload, a pipeline and tensor parallelism. And running out of memory in training: one line, never a hang.
Out of memory comes from APP_OOM_AT on one chosen rank or on every rank (tests/helpers/faults.py)."""
import json
import time

import pytest

from app.memory import autobatch
from conftest import (FAULTS, REPO, assert_one_error_line, config_variant, faulty_command, read_metrics, run,
                      train_jobs, write_text_rows)


def _auto(tmp, name, total, **changes):
    ds = json.loads((REPO / "ds_configs" / f"{name}.json").read_text())
    ds.pop("gradient_accumulation_steps")
    path = tmp / f"{name}-auto-{total}.json"
    path.write_text(json.dumps({**ds, "train_micro_batch_size_per_gpu": "auto", "train_batch_size": total,
                                **changes}))
    return path


RUN = ["--max_steps", 6, "--log_interval", 1, "--save_interval", 3]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> output of 2-rank jobs in one launch, each with its own out-of-memory fault point."""
    tmp = tmp_path_factory.mktemp("auto")
    from app.tools.instructions import write_prompts
    corpus, prompts = write_text_rows(tmp / "corpus.txt", 400), write_prompts(tmp / "prompts", 200, seed=1)
    text = ["--dataset", corpus, "--block_size", 32]
    jobs = {
        "dp": (["--deepspeed_config", _auto(tmp, "dp", 64), *RUN], "17:1"),
        "by hand": (["--deepspeed_config", config_variant(tmp, "dp", train_micro_batch_size_per_gpu=16,
                                                          gradient_accumulation_steps=2), *RUN], ""),
        "dp resumed": (["--deepspeed_config", _auto(tmp, "dp", 64), "--max_steps", 8, "--log_interval", 1,
                        "--resume", "auto"], ""),
        # forwards with collectives (ZeRO-3's gathers, a pipeline's sends, tensor-parallel all-reduces): every
        # rank runs out of memory at once, as ranks of one shape on one kind of GPU do
        "zero3": (["--deepspeed_config", _auto(tmp, "zero3", 64), *RUN], "9"),
        "zero2_offload": (["--deepspeed_config", _auto(tmp, "zero2_offload", 32), *RUN], "5:1"),
        "pipeline": (["--deepspeed_config", _auto(tmp, "pipeline", 32), *RUN], "9"),
        "tensor_parallel": (["--deepspeed_config", _auto(tmp, "tensor_parallel", 16), "--model", "llama-tiny", *text,
                             *RUN], "5"),
        # online RL: each trial samples its prompts' groups first (2 completions a prompt: 9 sequences are 5 prompts)
        "grpo": (["--deepspeed_config", _auto(tmp, "zero3", 16), "--task", "grpo", "--model", "llama-tiny",
                  "--tokenizer", "bytes", "--dataset", prompts, "--reward", f"{prompts.parent / 'rewards.py'}:"
                  "exact_answer", "--num_generations", 2, "--max_completion_length", 4, "--eval_answers", 0,
                  *RUN], "9"),
        "nothing fits": (["--deepspeed_config", _auto(tmp, "dp", 64), *RUN], "1:1"),
        "out of memory in training": (RUN, "1"),
    }
    out = {name: tmp / name.replace(" ", "-") for name in jobs}
    out["dp resumed"] = out["dp"]
    job_list = [{"argv": [*argv, "--output_dir", out[name]], "env": {"APP_OOM_AT": fault} if fault else {}}
                for name, (argv, fault) in jobs.items()]
    outputs = train_jobs("ranks", 2, job_list, codes=[2 if name in ("nothing fits", "out of memory in training") else 0
                                                      for name in jobs], wrapper=(FAULTS,))
    return {name: (output, out[name]) for name, output in zip(jobs, outputs)}


@pytest.mark.parametrize("name, micro, accumulation, failing", [
    ("dp", 16, 2, "32: out of memory: APP_OOM_AT=17:1 refuses a micro batch of 32 on rank 1"),
    ("zero3", 8, 4, "16: out of memory: APP_OOM_AT=9 refuses a micro batch of 16 on rank 0"),
    ("zero2_offload", 4, 4, "8: out of memory: APP_OOM_AT=5:1 refuses a micro batch of 8 on rank 1"),
    ("pipeline", 8, 4, "16: out of memory: APP_OOM_AT=9"),  # 2 stages: one replica takes the whole batch
    ("tensor_parallel", 4, 4, "8: out of memory: APP_OOM_AT=5"),  # 2 shards: one replica
])
def test_auto_picks_the_largest_micro_batch_every_rank_runs(name, micro, accumulation, failing, runs):
    output, folder = runs[name]
    line = next(line for line in output.splitlines() if line.startswith("micro batch: "))
    assert f"\"auto\" picked {micro}, the largest of" in line and failing in line, line
    assert f"{accumulation} accumulation step(s)" in line
    state = json.loads((folder / "checkpoints" / "step00000006" / "trainer_state.json").read_text())
    assert (state["deepspeed_config"]["train_micro_batch_size_per_gpu"],
            state["deepspeed_config"]["gradient_accumulation_steps"]) == (micro, accumulation)
    losses = [row["loss"] for row in read_metrics(folder)[0]]
    assert len(losses) >= 6 and losses[-1] < losses[0], "it trains on from there"


def test_auto_finds_a_grpo_runs_micro_batch_with_its_sampling_in_each_trial(runs):
    """A GRPO trial samples its prompts' completions, then trains on them: a micro batch of 8 prompts (16 sequences)
    runs out of memory, 4 (8) runs, and the run trains at 4 x 2."""
    output, folder = runs["grpo"]
    line = next(line for line in output.splitlines() if line.startswith("micro batch: "))
    assert "\"auto\" picked 4, the largest of" in line and "2 accumulation step(s)" in line, line
    assert "8: out of memory: APP_OOM_AT=9 refuses a micro batch of 16" in line, line
    state = json.loads((folder / "checkpoints" / "step00000006" / "trainer_state.json").read_text())
    assert state["deepspeed_config"]["train_micro_batch_size_per_gpu"] == 4
    assert [row["step"] for row in read_metrics(folder)[0]] == [1, 2, 3, 4, 5, 6]


def test_auto_gives_the_losses_of_the_same_micro_batch_written_by_hand(runs):
    """The trials leave no trace: the same weights, data order and random state as a run without them."""
    auto = [row["loss"] for row in read_metrics(runs["dp"][1])[0]][:6]
    by_hand = [row["loss"] for row in read_metrics(runs["by hand"][1])[0]]
    assert auto == by_hand


def test_a_resume_takes_the_micro_batch_its_checkpoint_recorded(runs):
    output, folder = runs["dp resumed"]
    assert "micro batch: 16 from " in output and "picked" not in output, "the checkpoint's choice, no search"
    assert [row["step"] for row in read_metrics(folder)[0]] == list(range(1, 9))


def test_when_not_even_one_sample_fits_it_is_one_line(runs):
    output, folder = runs["nothing fits"]
    assert_one_error_line(output, "not even a micro batch of 1 fits", "on rank 1", "python -m app.tools.plan")
    assert not (folder / "metrics.csv").exists()


def test_every_rank_out_of_memory_in_training_is_one_line_saying_what_to_change(runs):
    output, folder = runs["out of memory in training"]
    assert_one_error_line(output, "every rank ran out of memory after 0 step(s) (out of memory: APP_OOM_AT=1 "
                          "refuses a micro batch of 32)", "lower train_micro_batch_size_per_gpu",
                          "python -m app.tools.plan")
    assert not (folder / "metrics.csv").exists(), "nothing left that would refuse the same command"


def test_a_rank_out_of_memory_alone_in_a_backward_ends_the_run_in_one_line_not_a_hang(tmp_path):
    """Rank 1 runs out of memory in a trial's backward while rank 0 goes on into the gradient all-reduce and
    waits there for it: they cannot agree any more, so rank 1 waits a bounded time (not --dist_timeout), then
    says in one line which micro batch to write, and the launcher ends rank 0. The wait (30 s plus 10x the
    failed part) is shortened to 3 s here with APP_PATIENCE_S."""
    config, out = _auto(tmp_path, "dp", 64), tmp_path / "run"
    started = time.monotonic()
    result = run(faulty_command("deepspeed", 2, "--deepspeed_config", config, *RUN, "--output_dir", out),
                 timeout=300, APP_OOM_AT="17:1:backward", APP_PATIENCE_S="3")
    took = time.monotonic() - started
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert_one_error_line(result.stdout + result.stderr, "[rank 1] error: the micro batch search ended: rank 1 ran "
                          "out of memory with a micro batch of 32", "went on into that step's collectives",
                          f"set train_micro_batch_size_per_gpu in {config} to less than 32", anywhere=True)
    assert took < 60, f"ended after {took:.0f} s: the bounded wait is 3 s here"
    assert not (out / "metrics.csv").exists()


def test_a_rank_out_of_memory_alone_in_training_ends_the_run_in_one_line_not_a_hang(tmp_path):
    """The same in a training step, on rank 0, which serves the rendezvous store: it runs out of memory in its
    backward while rank 1 waits in the gradient all-reduce; rank 0 says it alone after a bounded wait, and rank
    1, whose collective fails as rank 0 goes, has read from the store that it left and ends without a line (or
    a traceback) of its own; the run's files go, so the same command runs again."""
    out = tmp_path / "run"
    started = time.monotonic()
    result = run(faulty_command("deepspeed", 2, *RUN, "--output_dir", out), timeout=300,
                 APP_OOM_AT="1:0:backward", APP_PATIENCE_S="1")
    took = time.monotonic() - started
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert_one_error_line(result.stdout + result.stderr, "error: rank 0 ran out of memory after 0 step(s)",
                          "while the other ranks went on into that step's collectives",
                          "lower train_micro_batch_size_per_gpu", anywhere=True)
    assert took < 60, f"ended after {took:.0f} s: the bounded wait in training is 5 s (1 s here: APP_PATIENCE_S)"
    assert not (out / "metrics.csv").exists()


def _engines_left_after_the_search(rank, world, config, out, report):
    """Train one step after a search whose trials ran out of memory; count the DeepSpeed engines alive when
    the search has returned."""
    import gc
    import os
    from deepspeed.runtime.engine import DeepSpeedEngine
    from app import train
    from app import settings as app_config
    from app.distributed import dist
    from app.distributed import launch
    from helpers import faults
    os.environ["APP_OOM_AT"] = "17"
    faults.out_of_memory()
    settle, left = autobatch.settle, []

    def observed(*args, **kwargs):
        ds = settle(*args, **kwargs)  # which collects the trials' garbage itself
        left.append(sum(DeepSpeedEngine in type(o).__mro__ for o in gc.get_objects()))
        return ds
    autobatch.settle = observed
    launch.prepare_environment()
    settings, ds = app_config.parse(["--deepspeed_config", str(config), "--max_steps", "1", "--output_dir",
                                     str(out)])
    code = train.run(settings, ds, launch.setup(timeout_s=60), time.perf_counter())
    dist.teardown()
    report.write_text(json.dumps([code, left]))


@pytest.mark.parametrize("name", ["dp", "zero3"])
def test_trial_engines_are_gone_before_the_run_builds_its_own(name, tmp_path):
    """A trial engine left alive holds its weights, optimizer state and buckets on the GPU while the next trial
    and the run's engine are built: spurious out-of-memory, a smaller micro batch than fits."""
    from conftest import spawn_ranks
    report = tmp_path / "report.json"
    spawn_ranks(1, _engines_left_after_the_search, _auto(tmp_path, name, 64), tmp_path / "run", report)
    assert json.loads(report.read_text()) == [0, [0]]
