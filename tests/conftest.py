"""Shared helpers: run the app for real (subprocess, real launchers) and read what it wrote.

tests/unit/ holds the tests that run in this process alone; tests/e2e/ those that start a subprocess, a launcher
or ranks, or build a DeepSpeed engine, all marked `slow` here; tests/helpers/ what several of them share. The
markers are registered in pytest.ini; `pytest tests/unit` (make test-fast) runs in under a minute.
"""
import atexit
import contextlib
import csv
import io
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from helpers import forks
from helpers.engines import engine_of  # noqa: F401 (the tests' own, from here)

os.environ["HF_HUB_OFFLINE"] = "1"  # tests never reach a model hub or dataset host
# The CPU tests pin themselves (and every process they start) to the CPU, so the suite runs the same on a
# machine with GPUs; tests/e2e/test_cuda.py gets the machine's own devices back through cuda_env().
VISIBLE_DEVICES = os.environ.get("CUDA_VISIBLE_DEVICES")
os.environ.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
# torch.compile on the CPU stands in for the GPU's: inductor writes scalar C++ kernels, not vectorised ones, which it
# generates and gcc builds a quarter faster; what the tests check of a compiled run does not depend on them
os.environ["TORCHINDUCTOR_VEC_ISA_OK"] = "0"
# a process of a test that dies of a signal (a segfault in a library) prints its Python stack first
os.environ["PYTHONFAULTHANDLER"] = "1"
# datasets' cache of loaded and tokenized files, fresh for each session (read when datasets is imported), removed
# at its end
os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="hf-datasets-")
atexit.register(shutil.rmtree, os.environ["HF_DATASETS_CACHE"], True)

from app.distributed.launch import free_port  # noqa: E402 (after the variables above; the tests' ports too)

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# TESTS_WITHOUT_FORKS=1: every command a fresh process (python by subprocess, ranks by the deepspeed launcher, a
# test's function on ranks by torch.multiprocessing.spawn), to measure what the forks save or rule them out
WITHOUT_FORKS = os.environ.get("TESTS_WITHOUT_FORKS") == "1"


def pytest_collection_modifyitems(items):
    """Every test in tests/e2e/ is slow; one that takes the loopback cluster is multinode."""
    for item in items:
        if "e2e" in item.path.parts:
            item.add_marker(pytest.mark.slow)
        if "cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.multinode)


def assert_one_error_line(output: str, *fragments, anywhere: bool = False) -> str:
    """The one `error: ...` line of a failed command's output (its stderr), holding every fragment; no traceback.

    anywhere: an error line is any line containing `error:` (a launcher may prefix it with the host it came
    from), except DeepSpeed's own `[ERROR]` log lines; otherwise it is a line starting with `error:`.
    """
    def is_error(line: str) -> bool:
        return "error:" in line and "[ERROR]" not in line if anywhere else line.startswith("error:")

    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if is_error(line)]
    assert len(errors) == 1, output[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def train_command(launcher: str, nproc: int, *args, script: str = "app/train.py") -> list:
    """The command a user would type for this launcher."""
    args = [str(a) for a in args]
    if launcher == "python":
        return [sys.executable, script, *args]
    if launcher == "deepspeed":
        return [str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(free_port()), script, *args]
    if launcher == "torchrun":
        return [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(free_port()), script,
                *args]
    raise ValueError(launcher)


FAULTS = "tests/helpers/faults.py"
"""Runs a script with the faults its environment names (APP_KILL_AT, APP_OOM_AT, ...), injected from outside the app."""


def faulty_command(launcher: str, nproc: int, *args) -> list:
    """train_command for app/train.py run by tests/helpers/faults.py."""
    return train_command(launcher, nproc, "app/train.py", *args, script=FAULTS)


def cuda_env() -> dict:
    """The environment as the machine gave it: its GPUs visible, DeepSpeed picking its accelerator."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "DS_ACCELERATOR")}
    return env if VISIBLE_DEVICES is None else {**env, "CUDA_VISIBLE_DEVICES": VISIBLE_DEVICES}


def run(cmd, timeout=600, base_env=None, cwd=REPO, **env) -> subprocess.CompletedProcess:
    """Run cmd in cwd (the repository root) with the test environment (or base_env); output captured as text."""
    full_env = {**(os.environ if base_env is None else base_env), "PYTHONUNBUFFERED": "1", **env}
    started = time.perf_counter()
    try:
        if str(cmd[0]) == sys.executable and base_env is None and not WITHOUT_FORKS:  # a fork of a preloaded python
            return forks.run_python(cmd[1:], full_env, cwd, timeout)
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env)
    finally:
        log_launch(cmd, time.perf_counter() - started)


def log_launch(cmd, seconds: float):
    """With TEST_LAUNCH_LOG=<file>, one JSON line per command a test starts: the test, the seconds, the command
    (where the suite's time goes: docs/tests.md)."""
    log = os.environ.get("TEST_LAUNCH_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "seconds": round(seconds, 2),
                                "command": " ".join(str(part) for part in cmd)}) + "\n")


def told(result, err: int = 4000, out: int = 4000) -> str:
    """A failed command's exit code and the ends of its output for a test's failure message; a crash's list of
    loaded extension modules (faulthandler's, thousands of characters) left out so that its tracebacks fit."""
    stderr = re.sub(r"\n *Extension modules: [^\n]*", "", result.stderr)
    return f"exit {result.returncode}\n{result.stdout[-out:]}\n{stderr[-err:]}"


def train(launcher="python", nproc=1, *args, timeout=600, base_env=None, **env):
    """Run a training job (with env added) and fail the test with its output if it did not exit 0."""
    result = run(train_command(launcher, nproc, *args), timeout=timeout, base_env=base_env, **env)
    assert result.returncode == 0, told(result)
    return result


def launch_script(nproc: int, script: str, *args, timeout=900, base_env=None, **env) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus nproc script args` where what is tested is not the launcher: the tests' own launch
    scripts (tests/helpers/jobs.py, host_syncs.py), runs killed on purpose. On the CPU its ranks are forks of the
    preloaded python (helpers/forks.py), which saves the launcher's start-up and each rank's imports; with
    base_env (the CUDA tests) it is the deepspeed launcher."""
    if base_env is not None or WITHOUT_FORKS:
        return run(train_command("deepspeed", nproc, *args, script=script), timeout=timeout, base_env=base_env, **env)
    started = time.perf_counter()
    try:
        return forks.run_ranks(nproc, [script, *args], {**os.environ, "PYTHONUNBUFFERED": "1", **env}, REPO, timeout)
    finally:
        log_launch([f"{nproc} ranks:", script, *args], time.perf_counter() - started)


def _running(folder, jobs: list, nproc: int) -> str:
    """The job of train_jobs that some rank had not finished: its number and arguments."""
    for i, job in enumerate(jobs):
        if not all((Path(folder) / f"{i}.rank{r}.code").exists() for r in range(nproc)):
            return f"job {i}: {' '.join(map(str, job['argv'] if isinstance(job, dict) else job))}"
    return "no job (every job had ended)"


def train_jobs(launcher: str, nproc: int, jobs: list, timeout=900, base_env=None, codes=None, wrapper=()) -> list:
    """The output of each of several training jobs (argument lists, or {"argv": [...], "env": {...}}) run one
    after another in one process group (tests/helpers/jobs.py): every rank's, rank 0's first. launcher: "ranks"
    (nproc ranks as launch_script starts them) or "python" (one process, no launcher). Fails the test with the output
    if a job's ranks did not exit with its code in codes (default: 0 for every job). wrapper: a script and its
    arguments that run jobs.py (tests/helpers/nan_grads.py)."""
    with tempfile.TemporaryDirectory() as folder:
        jobs_file = Path(folder) / "jobs.json"
        jobs_file.write_text(json.dumps([{"argv": [str(a) for a in job["argv"]], "env": job.get("env", {})}
                                         if isinstance(job, dict) else [str(a) for a in job] for job in jobs]))
        script, *args = [*wrapper, "tests/helpers/jobs.py", jobs_file, folder]
        if launcher == "python":
            result = run(train_command("python", 1, *args, script=script), timeout=timeout, base_env=base_env)
        else:
            result = launch_script(nproc, script, *args, timeout=timeout, base_env=base_env)
        assert result.returncode == 0, f"{_running(folder, jobs, nproc)}: {told(result, 12000)}"
        outputs = []
        for i in range(len(jobs)):
            output = "".join((Path(folder) / f"{i}.rank{r}.txt").read_text() for r in range(nproc))
            got = [(Path(folder) / f"{i}.rank{r}.code").read_text() for r in range(nproc)]
            assert got == [str(codes[i] if codes else 0)] * nproc, f"job {i} exited {got}\n{output[-3000:]}"
            outputs.append(output)
            argv = jobs[i]["argv"] if isinstance(jobs[i], dict) else jobs[i]  # one log line per job too
            log_launch([f"job {i}:", *argv], float((Path(folder) / f"{i}.rank0.seconds").read_text()))
        return outputs


def named_jobs(tmp: Path, two: dict, one: dict, refused: set, wrapper=()) -> dict:
    """{name: (its run folder, its output)} of named train.py jobs: the 2-rank ones in one launch, then the
    one-process ones, each writing to tmp/<name>. A job is an argument list, or {"argv": [...], "env": {...},
    "folder": another job's name} (folder: go on in that job's run, a resume); refused: the jobs that end in one line
    (exit 2)."""
    def folder(name, job):
        return tmp / (job.get("folder", name) if isinstance(job, dict) else name)

    def argv(name, job):
        given = job if isinstance(job, dict) else {"argv": job}
        return {"argv": [*given["argv"], "--output_dir", folder(name, job)], "env": given.get("env", {})}
    outputs = train_jobs("ranks", 2, [argv(n, j) for n, j in two.items()],
                         codes=[2 if n in refused else 0 for n in two], wrapper=wrapper)
    outputs += train_jobs("python", 1, [argv(n, j) for n, j in one.items()],
                          codes=[2 if n in refused else 0 for n in one])
    return {name: (folder(name, job), output) for (name, job), output in zip([*two.items(), *one.items()], outputs)}


def read_metrics(output_dir: Path):
    """(train rows, eval rows) from metrics.csv, numbers parsed."""
    with open(output_dir / "metrics.csv") as f:
        rows = [{k: (float(v) if v != "" else None) for k, v in row.items()} for row in csv.DictReader(f)]
    return [r for r in rows if r["loss"] is not None], [r for r in rows if r["eval_loss"] is not None]


def read_summary(output_dir: Path) -> dict:
    return json.loads((output_dir / "summary.json").read_text())


def config_variant(tmp_path: Path, name: str, **changes) -> Path:
    """A copy of ds_configs/<name>.json with top-level keys changed, written under tmp_path."""
    ds = json.loads((REPO / "ds_configs" / f"{name}.json").read_text())
    ds.update(changes)
    path = tmp_path / f"{name}-variant.json"
    path.write_text(json.dumps(ds))
    return path


# The standard 2-rank run of a ds_config: 2 epochs of 23 steps (1,437 digits / (32 x 2 ranks)), a
# metrics row every step and a checkpoint every 5. The end-to-end and the resume tests share it.
TWO_RANK_ARGS = ["--epochs", 2, "--log_interval", 1, "--save_interval", 5, "--keep_last", 3]
NOT_FOR_THE_CNN = {"tensor_parallel": "tests/e2e/test_tensor_parallel.py trains llama-tiny with it",
                   "sequence_parallel": "tests/e2e/test_sequence_parallel.py trains llama-tiny with it"}
TWO_RANK_STEPS = 46  # 2 epochs of 1437 digits / (32 x 2 data-parallel ranks)


def two_rank_steps(name: str) -> int:
    """Steps of the standard 2-rank run of ds_configs/<name>.json: pipeline.json's 2 ranks are one replica."""
    return 2 * -(-1437 // (32 * (1 if name == "pipeline" else 2)))


@pytest.fixture(scope="session")
def two_rank_run(tmp_path_factory):
    """name -> (output_dir, stdout) of the standard 2-rank run of ds_configs/<name>.json: every config's run,
    made at the first call, one after another in one launch."""
    root = tmp_path_factory.mktemp("two-rank")
    names = sorted(p.stem for p in (REPO / "ds_configs").glob("*.json") if p.stem not in NOT_FOR_THE_CNN)
    jobs = [["--deepspeed_config", REPO / "ds_configs" / f"{name}.json", *TWO_RANK_ARGS, "--output_dir", root / name]
            for name in names]
    done = {}

    def get(name):
        if not done:
            done.update({n: (root / n, out) for n, out in zip(names, train_jobs("ranks", 2, jobs))})
        return done[name]
    return get


@pytest.fixture(scope="session")
def one_process_run(tmp_path_factory):
    """(output_dir, stdout) of `python app/train.py` with the defaults, 6 steps, a row every 2 (made once)."""
    out = tmp_path_factory.mktemp("one-process") / "run"
    result = train("python", 1, "--max_steps", 6, "--log_interval", 2, "--output_dir", out)
    return out, result.stdout


@pytest.fixture
def repo():
    return REPO


ANIMALS = ["cat", "dog", "bird", "fish", "horse", "cow", "goat", "owl"]
VERBS = ["sees", "likes", "chases", "finds", "follows"]
ADJECTIVES = ["red", "big", "small", "happy", "old", "quick"]
MAMMALS = {"cat", "dog", "horse", "cow", "goat"}


def sentences(n: int, seed: int = 0):
    """(sentence, label) pairs from a small grammar; label 1 when the subject is a mammal."""
    gen = random.Random(seed)
    for _ in range(n):
        subject = gen.choice(ANIMALS)
        text = f"the {gen.choice(ADJECTIVES)} {subject} {gen.choice(VERBS)} the {gen.choice(ANIMALS)} ."
        yield text, int(subject in MAMMALS)


def started_tokenizer(post: str = "<s> $A"):
    """A byte-level tokenizer whose own start token, <s>, is not its end of text, </s>, as Llama's, Gemma's and
    Mistral's tokenizers add theirs (post: its template for one text, tokenizers' TemplateProcessing)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({"<s>": 256, "</s>": 257, "<pad>": 258})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<s>", "</s>", "<pad>"])
    backend.post_processor = processors.TemplateProcessing(single=post, special_tokens=[("<s>", 256), ("</s>", 257)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def write_text_rows(path: Path, n: int, seed: int = 0, labelled: bool = False) -> Path:
    """Generated sentences (with labels when asked) in the format path's suffix names."""
    rows = [{"text": t, **({"label": y} if labelled else {})} for t, y in sentences(n, seed)]
    if path.suffix == ".txt":
        path.write_text("".join(r["text"] + "\n" for r in rows))
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        import pandas
        frame = pandas.DataFrame(rows)
        frame.to_csv(path, index=False) if path.suffix == ".csv" else frame.to_parquet(path)
    return path


def _prepared(rank, world, fn, args):
    from app.distributed.launch import prepare_environment
    prepare_environment()  # as app/train.py's ranks: this Python's ninja, or a JIT op is rebuilt (docs/tests.md)
    fn(rank, world, *args)


def spawn_ranks(world: int, fn, *args, timeout=300):
    """Run fn(rank, world, *args) on `world` ranks (forks of the preloaded python, helpers/forks.py, with the
    launcher's variables; fn a module's top-level function); fail the test with their output if one fails, and
    end them all past timeout."""
    if WITHOUT_FORKS:
        return _spawn_fresh(world, fn, args, timeout)
    result = forks.call_ranks(world, _prepared, (fn, args), dict(os.environ), os.getcwd(), timeout)
    assert result.returncode == 0, told(result)


def _fresh_rank(rank, world, port, fn, args):
    from app.distributed.launch import rank_env
    os.environ.update(rank_env(rank, world, port))
    _prepared(rank, world, fn, args)


def _spawn_fresh(world: int, fn, args: tuple, timeout: float):
    """spawn_ranks with TESTS_WITHOUT_FORKS=1: fresh processes, a failing rank ending the others (its traceback
    fails the test)."""
    import torch.multiprocessing
    ranks = torch.multiprocessing.start_processes(_fresh_rank, (world, free_port(), fn, args), nprocs=world,
                                                  join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ranks.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail(f"{world} ranks of {fn.__qualname__} still running after {timeout} s")


def _main_each(rank, world, cases, report):
    from app import train as app_train
    results = []
    for argv in cases:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = app_train.main([str(a) for a in argv])
        results.append((code, err.getvalue()))
    report.write_text(json.dumps(results))


def main_each(cases: list) -> list:
    """(exit code, stderr) of train.main for each argv, all in one fresh process (one start-up for all)."""
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "report.json"
        spawn_ranks(1, _main_each, cases, report)
        return [tuple(r) for r in json.loads(report.read_text())]


@contextlib.contextmanager
def tmpfs(path, size: str, read_only=False):
    """A fresh tmpfs of `size` mounted at path for the block."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}{',ro' if read_only else ''}", "tmpfs", str(path)],
                   check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)
