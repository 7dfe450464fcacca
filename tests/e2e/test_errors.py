"""A user's mistake: one clear line on stderr, no traceback, non-zero exit, nothing overwritten."""
import json
from pathlib import Path

import pytest

from conftest import REPO, assert_one_error_line, main_each, run, train, train_command


def _fails_cleanly(result, *expected):
    """result: a CompletedProcess, or (exit code, stderr) from main_each."""
    code, stderr, stdout = (result.returncode, result.stderr, result.stdout) if hasattr(result, "stderr") else \
        (*result, "")
    assert code != 0, stdout
    assert "Traceback" not in stdout, stdout
    return assert_one_error_line(stderr, *expected)


def _config(tmp_path, text, name="bad"):
    path = tmp_path / f"{name.replace(' ', '-')}.json"
    path.write_text(text if isinstance(text, str) else json.dumps(text))
    return path


def _dp(**changes):
    ds = json.loads((REPO / "ds_configs" / "dp.json").read_text())
    ds.update(changes)
    return ds


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """An output directory holding a finished run, which no failing command may touch."""
    out = tmp_path_factory.mktemp("kept") / "run"
    train("python", 1, "--max_steps", 2, "--output_dir", out)
    return out, {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}


CASES = {
    "malformed json": ('{"train_micro_batch_size_per_gpu": 4,,}', ["not valid JSON", "line 1"]),
    "unknown top-level key": (_dp(steps_per_prnt=10), ["unknown DeepSpeed key 'steps_per_prnt'",
                                                        "did you mean 'steps_per_print'"]),
    "unknown zero key": (_dp(zero_optimization={"stage": 2, "overlap_com": True}),
                         ["zero_optimization.overlap_com", "did you mean 'overlap_comm'"]),
    "unknown optimizer param": (_dp(optimizer={"type": "AdamW", "params": {"lr": 0.001, "weight_decya": 0.1}}),
                                ["weight_decya"]),
    "unknown optimizer field": (_dp(optimizer={"type": "AdamW", "parms": {"lr": 0.001}}), ["optimizer.parms"]),
    "batch sizes that cannot agree": (_dp(train_batch_size=48), ["train_batch_size 48 != train_micro_batch_size_per_gpu 32",
                                                                  "data-parallel ranks 1 = 32"]),
    "non-positive batch": (_dp(train_micro_batch_size_per_gpu=0), ["train_micro_batch_size_per_gpu must be a positive"]),
    "duplicate key": ('{"train_micro_batch_size_per_gpu": 4, "train_micro_batch_size_per_gpu": 8}', ["appears twice"]),
}
FLAG_CASES = {
    "missing config": (["--deepspeed_config", REPO / "ds_configs/nope.json"], ["ds_configs/nope.json not found",
                                                                              "dp.json"]),
    "unknown model": (["--model", "resnet9000"], ["unknown model 'resnet9000'"]),
    "unknown dataset": (["--dataset", "imagenet22k"], ["unknown image dataset 'imagenet22k'", "digits"]),
    "empty imagefolder": (["--dataset", "imagefolder", "--data_dir", "/nonexistent/images"],
                          ["missing or empty", "/nonexistent/images"]),
    "absent mnist": (["--dataset", "mnist", "--data_dir", "/nonexistent/mnist"], ["MNIST is not in", "HF_HUB_OFFLINE"]),
    "zero epochs": (["--epochs", "0"], ["--epochs must be at least 1"]),
    "lora flags without --lora": (["--lora_rank", "16"], ["--lora_rank set the adapters of a LoRA run",
                                                          "add --lora"]),
    "model weights for the app's own model": (["--model_weights", "DEFAULT"],
                                              ["--model_weights starts a torchvision classifier", "cnn is the app's"]),
    "model weights for a transformers model": (["--model", "gpt2-tiny", "--model_weights", "DEFAULT"],
                                               ["--model_weights starts a torchvision classifier",
                                                "a transformers model's come with --model"]),
    "images too small for the model": (["--model", "alexnet", "--dataset", "synthetic"],
                                       ["--model alexnet cannot take the data's 32x32 images", "Output size is too small"]),
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, finished_run):
    """(exit code, stderr) of the command line for every bad config and bad flag, run in one process."""
    out, _ = finished_run
    folder = tmp_path_factory.mktemp("bad-configs")
    argvs = {name: ["--deepspeed_config", _config(folder, text, name)] for name, (text, _) in CASES.items()}
    argvs.update({name: args for name, (args, _) in FLAG_CASES.items()})
    results = main_each([[*argv, "--output_dir", out, "--max_steps", 2, "--overwrite"] for argv in argvs.values()])
    return dict(zip(argvs, results))


@pytest.mark.parametrize("case", sorted(CASES) + sorted(FLAG_CASES))
def test_bad_config_or_flag(case, outcomes, finished_run):
    out, before = finished_run
    _fails_cleanly(outcomes[case], *(CASES.get(case) or FLAG_CASES[case])[1])
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_existing_run_is_not_overwritten(finished_run):
    out, before = finished_run
    result = run(train_command("python", 1, "--output_dir", out, "--max_steps", 2))
    _fails_cleanly(result, "already holds a run", "--overwrite")
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_unwritable_output_dir(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = run(train_command("python", 1, "--output_dir", blocker / "run", "--max_steps", 2))
    _fails_cleanly(result, "cannot write to output directory", "pick a writable --output_dir")
    assert blocker.read_text() == "not a directory"


def test_a_batchnorm_model_given_one_sample_a_micro_batch_is_one_line(tmp_path):
    """resnet18's last BatchNorm sees a 1x1 map of 32-pixel images, which it cannot train on one sample: the step's
    error, eager or compiled, is one line naming the config's micro batch."""
    config = _config(tmp_path, _dp(train_micro_batch_size_per_gpu=1))
    args = ["--deepspeed_config", config, "--model", "resnet18", "--dataset", "synthetic", "--max_steps", 2]
    for compiled in ("off", "on"):
        result = main_each([[*args, "--compile", compiled, "--output_dir", tmp_path / compiled]])[0]
        _fails_cleanly(result, "BatchNorm layer cannot train on one value per channel", "[1, 512, 1, 1]",
                       "set train_micro_batch_size_per_gpu to 2 or more")


def test_batch_mismatch_names_the_world_size_with_two_ranks(tmp_path):
    """The numbers in the message are the real world size's, and only rank 0 says it."""
    result = run(train_command("deepspeed", 2, "--deepspeed_config", _config(tmp_path, _dp(train_batch_size=32)),
                               "--output_dir", tmp_path / "run"))
    _fails_cleanly(result, "x data-parallel ranks 2 = 64", "remove train_batch_size")
    assert not (tmp_path / "run" / "metrics.csv").exists()


def test_help_describes_every_flag():
    result = run(train_command("python", 1, "--help"))
    assert result.returncode == 0
    for flag in ("--model", "--dataset", "--data_dir", "--epochs", "--max_steps", "--eval_interval",
                 "--log_interval", "--output_dir", "--seed", "--num_workers", "--deepspeed_config"):
        assert flag in result.stdout
    assert "(default: 'cnn')" in result.stdout and "Passes over the training set" in result.stdout


@pytest.fixture
def memory_cgroup(tmp_path):
    """A cgroup v1 memory group of 4 GiB for a command's processes (`sh -c 'echo $$ > procs; exec ...'`): a machine
    (a container, a Slurm job with --mem) that gives a run less than its RAM. Removed after the test."""
    group = Path("/sys/fs/cgroup/memory") / f"app-test-{tmp_path.name}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(4 * 2**30))
    except OSError as e:
        pytest.skip(f"no cgroup v1 memory group can be made here ({e}): the check is held by tests/unit/test_host.py")
    yield group / "cgroup.procs"
    group.rmdir()


def test_a_host_too_small_for_what_the_ranks_offload_is_one_line_before_any_engine(tmp_path, memory_cgroup):
    """llama-1b under zero3_offload keeps 24 bytes a parameter on the host: 14.8 GB a rank of 2, more than a machine
    of 4 GiB (its cgroup's limit, not the RAM) gives them. Every rank stops at once, rank 0 says so, nothing is
    written."""
    import socket
    from conftest import write_text_rows
    corpus = write_text_rows(tmp_path / "corpus.txt", 50)
    command = train_command("deepspeed", 2, "--model", "llama-1b", "--tokenizer", "bytes", "--dataset", corpus,
                            "--deepspeed_config", REPO / "ds_configs" / "zero3_offload.json", "--block_size", 64,
                            "--output_dir", tmp_path / "run")
    result = run(["sh", "-c", f'echo $$ > {memory_cgroup} && exec "$@"', "sh", *map(str, command)], timeout=300)
    _fails_cleanly(result, "ds_configs/zero3_offload.json offloads 14.8 GB a rank to the host (the memory plan), 29.7 "
                   f"GB for the 2 rank(s) on {socket.gethostname()}, more than the 3.9 GB its memory gives them "
                   "(4.3 GB)", "run fewer ranks a machine")
    assert not (tmp_path / "run" / "metrics.csv").exists()


def test_the_accumulation_the_micro_batch_search_sets_is_held_to_the_host_before_the_run(tmp_path):
    """zero2_offload keeps on the host every gradient a rank's partition touches once the accumulation is above 1,
    which an "auto" micro batch leaves to the search. One process, counted as one of as many ranks on this machine
    (LOCAL_WORLD_SIZE) as hold its offloaded states without accumulation, passes the check at start; the search
    picks 4 of 16 (APP_OOM_AT=5), 4 accumulation steps, and the check then stops the run before its engine."""
    import math
    from types import SimpleNamespace
    from app.core import resolver
    from app.ds.config import load_ds_config
    from app.memory import host, planner
    from app.settings import Settings
    from conftest import faulty_command, write_text_rows
    ds = {**json.loads((REPO / "ds_configs" / "zero2_offload.json").read_text()), "train_batch_size": 16,
          "train_micro_batch_size_per_gpu": "auto"}
    ds.pop("gradient_accumulation_steps")
    config = _config(tmp_path, ds, "zero2_offload-auto")
    settings = Settings(model="gpt2-tiny", block_size=32, deepspeed_config=str(config))
    task, ranks = resolver.build(settings), SimpleNamespace(replicas=1, sequence=1)
    once, each = (planner._offloaded_here({**load_ds_config(config), "gradient_accumulation_steps": steps}, task,
                                          settings, ranks)[0] for steps in (1, 4))
    here = math.floor(host.USABLE_HOST * host.host_memory() / once)
    assert here * each > host.USABLE_HOST * host.host_memory(), "the check at start passes, the one after refuses"
    corpus = write_text_rows(tmp_path / "corpus.txt", 200)
    result = run(faulty_command("python", 1, "--model", "gpt2-tiny", "--dataset", corpus, "--block_size", 32,
                                "--deepspeed_config", config, "--max_steps", 2, "--output_dir", tmp_path / "run"),
                 APP_OOM_AT="5", LOCAL_WORLD_SIZE=str(here))
    assert "micro batch: \"auto\" picked 4, the largest of 1, 2, 4, 8, 16" in result.stdout, result.stdout[-3000:]
    _fails_cleanly(result, f"offloads {each / 1e9:,.1f} GB a rank to the host (the memory plan), "
                   f"{here * each / 1e9:,.1f} GB for the {here} rank(s) on")
    assert not (tmp_path / "run" / "metrics.csv").exists()
