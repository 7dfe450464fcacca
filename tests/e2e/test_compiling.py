"""torch.compile through the engine on CPU (inductor): every ZeRO stage, the same losses as one eager process, exact
resume."""
import json

import pytest

from e2e.test_checkpoint import assert_same_run
from e2e.test_train import STAGES, assert_two_ranks_match, one_process_reference
from conftest import (FAULTS, REPO, assert_one_error_line, config_variant, faulty_command, read_metrics, run, train,
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


# DeepSpeed's DeepCompile asked for in the file, which runs on CUDA devices only: zero3.json with it, on CPU ranks
DEEPCOMPILE = {"deepcompile": ("zero3", {}, 0)}


@pytest.fixture(scope="module")
def compiled_two_ranks(tmp_path_factory):
    """name -> (per-step losses, output) of 2 compiled ranks x micro batch 4, 12 steps, under each ZeRO stage,
    each fault of FAULTS and DEEPCOMPILE, one after another in one launch."""
    tmp = tmp_path_factory.mktemp("compiled-two")
    runs = {**{name: (name, {}, 0) for name in STAGES}, **FAULT_RUNS, **DEEPCOMPILE}
    asked = {name: {"compile": {"deepcompile": True}} for name in DEEPCOMPILE}
    for name in runs:  # a folder of each run's config: two runs' variants of one file differ
        (tmp / "configs" / name).mkdir(parents=True)
    jobs = [{"argv": ["--deepspeed_config", config_variant(tmp / "configs" / name, config,
                                                           train_micro_batch_size_per_gpu=4, **asked.get(name, {})),
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


def test_a_file_asking_for_deepcompile_trains_on_cpu_ranks_compiled_by_torch_as_without_it(compiled_two_ranks):
    """DeepSpeed would build DeepCompile's CUDA op on CPU ranks and fail in a traceback: the app turns it off there,
    says so, and the run is zero3.json's compiled run, loss for loss."""
    losses, output = compiled_two_ranks["deepcompile"]
    assert "compile.deepcompile = false  (DeepSpeed's DeepCompile runs on CUDA devices only" in output
    assert "Traceback" not in output and output.count(COMPILING) == 1
    assert losses == compiled_two_ranks["zero3"][0] and len(losses) == 12


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


def _step_peaks_over_logits(rank, world, report):
    """For GPT-2 shapes whose vocabulary is padded (50,257 -> 50,304, its pad masked) and not (50,304): the most
    resident memory a compiled ZeRO-3 step (the app's TrainStep, its third) holds above what it starts with, and
    the bytes of one copy of its logits."""
    import ctypes
    import psutil
    import torch
    from transformers import AutoConfig
    from app.core import models, resolver
    from app.data.loader import build_loader
    from app.distributed import launch
    from app.observe import metrics
    from app.observe.metrics import Meter
    from app.settings import Settings
    from conftest import engine_of
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: a freed tensor of 64 KiB or more leaves RSS
    launch.prepare_environment()
    launch.setup(timeout_s=60)
    ds = {key: value for key, value in json.loads((REPO / "ds_configs" / "zero3.json").read_text()).items()
          if key not in ("scheduler", "torch_autocast")} | {"train_micro_batch_size_per_gpu": 8}
    found = {}
    for vocab in (50257, 50304):
        task = resolver.build(Settings(model="gpt2-tiny"))
        config = AutoConfig.for_model("gpt2", n_layer=1, n_embd=64, n_head=2, n_positions=128, vocab_size=vocab,
                                      **models.NO_DROPOUT["gpt2"])
        models.pad_vocab(config)
        task.spec = models.HFSpec(config, "", "causal_lm", 128)
        data, info = task.sample_data(8 * 3, 128)
        torch.manual_seed(0)
        engine = engine_of(task.build_model(info, ds), ds)
        step = task.make_step(engine, True)
        meter = Meter(step.metrics, engine.device)
        for i, batch in enumerate(build_loader(data, 8, 0, 1, False, 0)):
            if i == 2:
                metrics.reset_peak_memory(engine.device)
                start = psutil.Process().memory_info().rss
            step.micro_step(batch, meter)
        found[vocab] = [metrics.peak_memory_bytes(engine.device) - start, 8 * 128 * config.vocab_size * 4]
        engine.destroy()
    report.write_text(json.dumps(found))


def test_a_padded_vocabulary_costs_a_compiled_zero3_step_no_second_copy_of_the_logits(tmp_path):
    """ZeRO-3's hooks break the compiled graph at the output layer, so the padded vocabulary's mask runs in a graph
    of its own. Masked in place there, the step held the logits twice at its peak (a graph output and the input it
    mutated); GPT-2 at 50,257 tokens padded to 50,304 then planned 13-17% under its H200 peak. Out of place it
    holds them once, as the same shape unpadded does."""
    from conftest import spawn_ranks
    report = tmp_path / "peaks.json"
    spawn_ranks(1, _step_peaks_over_logits, report)
    found = json.loads(report.read_text())
    (padded, logits), (whole, _) = found["50257"], found["50304"]
    print(f"step's peak above its start: padded {padded / 1e6:.1f} MB, unpadded {whole / 1e6:.1f} MB; one copy of "
          f"the logits {logits / 1e6:.1f} MB")
    assert whole > logits, found  # the step holds its logits: the measure sees them
    assert abs(padded - whole) < logits / 4, found



def _hooks_around_deepcompile(rank, world, report):
    """A ZeRO-3 engine of gpt2-tiny put in the state DeepSpeed's compile() leaves where DeepCompile compiles the step
    (its own forward hooks off: DeepCompile's passes do their work), then the app's hooks made eager as Compiled
    makes them; what the app then sees."""
    import torch
    from app.core import resolver
    from app.data.loader import build_loader
    from app.distributed import launch
    from app.ds import internals as ds_internals
    from app.settings import Settings
    from conftest import engine_of
    launch.prepare_environment()
    launch.setup(timeout_s=60)
    ds = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    task = resolver.build(Settings(model="gpt2-tiny"))
    data, info = task.sample_data(4, 32)
    torch.manual_seed(0)
    engine = engine_of(task.build_model(info, ds), ds)
    inputs = next(iter(build_loader(data, 4, 0, 1, False, 0)))[0]
    found = {"plain": engine(inputs).float().mean().item(), "active_before": ds_internals.deepcompile_active(engine)}
    engine._set_deepcompile_active(True)  # what compile() does where DeepCompile compiles the step
    found["hooks_off"] = [engine.module_forward_pre_hook, engine.module_forward_post_hook] == [None, None]
    ds_internals.engine_hooks_eager(engine)
    found["active"] = ds_internals.deepcompile_active(engine)
    found["then"] = engine(inputs).float().mean().item()  # ZeRO-3's hooks on the blocks still gather
    engine.destroy()
    report.write_text(json.dumps(found))


def test_the_engines_hooks_are_made_eager_where_deepcompile_took_its_own_off(tmp_path):
    """DeepCompile (CUDA only) takes the engine's own forward hooks off when it compiles the step: the app's making
    the engine's hooks eager passes over them there (it read each hook's id), and the app sees DeepCompile at work,
    so that a step its compiler refuses ends the run in one line (tests/unit/test_compiling.py), not eager."""
    from conftest import spawn_ranks
    report = tmp_path / "found.json"
    spawn_ranks(1, _hooks_around_deepcompile, report)
    found = json.loads(report.read_text())
    assert not found["active_before"] and found["hooks_off"] and found["active"], found
    assert abs(found["then"] - found["plain"]) < 1e-6, found
