"""A user's mistake: one clear line on stderr, no traceback, non-zero exit, nothing overwritten."""
import json
from types import SimpleNamespace

import pytest

from app.errors import RankAlone, SaidByAnotherRank, UserError, first_line, report
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
                                                                  "world size 1 = 32"]),
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


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES) + sorted(FLAG_CASES))
def test_bad_config_or_flag(case, outcomes, finished_run):
    out, before = finished_run
    _fails_cleanly(outcomes[case], *(CASES.get(case) or FLAG_CASES[case])[1])
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


@pytest.mark.slow
def test_existing_run_is_not_overwritten(finished_run):
    out, before = finished_run
    result = run(train_command("python", 1, "--output_dir", out, "--max_steps", 2))
    _fails_cleanly(result, "already holds a run", "--overwrite")
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


@pytest.mark.slow
def test_unwritable_output_dir(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = run(train_command("python", 1, "--output_dir", blocker / "run", "--max_steps", 2))
    _fails_cleanly(result, "cannot write to output directory", "pick a writable --output_dir")
    assert blocker.read_text() == "not a directory"


@pytest.mark.slow
def test_batch_mismatch_names_the_world_size_with_two_ranks(tmp_path):
    """The numbers in the message are the real world size's, and only rank 0 says it."""
    result = run(train_command("deepspeed", 2, "--deepspeed_config", _config(tmp_path, _dp(train_batch_size=32)),
                               "--output_dir", tmp_path / "run"))
    _fails_cleanly(result, "x world size 2 = 64", "remove train_batch_size")
    assert not (tmp_path / "run" / "metrics.csv").exists()


@pytest.mark.slow
def test_help_describes_every_flag():
    result = run(train_command("python", 1, "--help"))
    assert result.returncode == 0
    for flag in ("--model", "--dataset", "--data_dir", "--epochs", "--max_steps", "--eval_interval",
                 "--log_interval", "--output_dir", "--seed", "--num_workers", "--deepspeed_config"):
        assert flag in result.stdout
    assert "(default: 'cnn')" in result.stdout and "Passes over the training set" in result.stdout


def test_report_says_one_line_on_stderr_and_returns_2(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert report(UserError("--epochs must be at least 1, got 0")) == 2
    said = capsys.readouterr()
    assert said.err == "error: --epochs must be at least 1, got 0\n" and said.out == ""
    assert_one_error_line(said.err, "--epochs must be at least 1")


def test_report_on_another_rank_waits_for_rank_0_and_names_itself(monkeypatch, capsys):
    """Rank 0 speaks first; by the time another rank would, the launcher has usually ended it."""
    import app.errors
    waited = []
    monkeypatch.setattr(app.errors, "time", SimpleNamespace(sleep=waited.append))
    monkeypatch.setenv("RANK", "3")
    assert report(UserError("the same mistake")) == 2
    assert waited == [3] and capsys.readouterr().err == "[rank 3] error: the same mistake\n"


def test_a_rank_that_leaves_alone_speaks_at_once_and_the_others_say_nothing(monkeypatch, capsys):
    """RankAlone: only this rank knows, and the launcher ends the others once it exits; SaidByAnotherRank: the
    rank that left said it."""
    import app.errors
    waited = []
    monkeypatch.setattr(app.errors, "time", SimpleNamespace(sleep=waited.append))
    monkeypatch.setenv("RANK", "1")
    assert report(RankAlone("rank 1 ran out of memory")) == 2
    assert waited == [] and capsys.readouterr().err == "[rank 1] error: rank 1 ran out of memory\n"
    monkeypatch.setenv("RANK", "0")
    assert report(SaidByAnotherRank("rank 1 ran out of memory")) == 2
    assert capsys.readouterr().err == ""


def test_first_line_is_the_innermost_cause():
    try:
        try:
            raise OSError("disk full\nwhile writing /data/x")
        except OSError as inner:
            raise RuntimeError("DatasetGenerationError: An error occurred") from inner
    except RuntimeError as wrapped:
        assert first_line(wrapped) == "disk full"
    try:
        try:
            raise KeyError("text")
        except KeyError:
            raise ValueError("while mapping")  # implicit chaining: __context__
    except ValueError as chained:
        assert first_line(chained) == "'text'"
    assert first_line(ValueError()) == "ValueError" and first_line(ValueError("  one\ntwo")) == "one"


def test_an_error_raised_in_deepspeeds_code_is_one_line_naming_where():
    """A section of a borrowed config that the model or machine does not suit fails inside DeepSpeed: one line
    saying where, not a traceback; an error from elsewhere stays the bug it is."""
    from app.errors import deepspeed_failure
    scope = {}
    exec(compile("def step():\n    raise RuntimeError('start (114) + length (1843) exceeds dimension size (114).')",
                 "/venv/site-packages/deepspeed/runtime/zenflow/engine.py", "exec"), scope)
    try:
        scope["step"]()
    except RuntimeError as e:
        said = str(deepspeed_failure(e, "in training step 1"))
    assert said.startswith("DeepSpeed failed in training step 1 (RuntimeError: start (114)") and \
        "deepspeed/runtime/zenflow/engine.py:2" in said and "\n" not in said
    try:
        raise RuntimeError("ours")
    except RuntimeError as e:
        assert deepspeed_failure(e, "x") is None
