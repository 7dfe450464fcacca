"""How a user's mistake is said: one line on stderr and exit code 2, by rank 0; a rank that ends alone says its
own; the innermost cause first, an error raised in DeepSpeed's code named where. The mistakes on a real command
line: tests/e2e/test_errors.py."""
from app.errors import Ended, UserError, first_line, report
from conftest import assert_one_error_line


def test_report_says_one_line_on_stderr_and_returns_2(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert report(UserError("--epochs must be at least 1, got 0")) == 2
    said = capsys.readouterr()
    assert said.err == "error: --epochs must be at least 1, got 0\n" and said.out == ""
    assert_one_error_line(said.err, "--epochs must be at least 1")


def test_a_users_mistake_is_rank_0s_to_say(monkeypatch, capsys):
    """Every rank raises it (found by each, or told by rank 0): another rank says nothing and waits for nobody."""
    monkeypatch.setenv("RANK", "3")
    assert report(UserError("the same mistake")) == 2
    assert capsys.readouterr().err == ""


def test_a_rank_that_ends_alone_speaks_at_once_and_the_others_say_nothing(monkeypatch, capsys):
    """Ended(alone=True): only this rank knows, and the launcher ends the others once it exits; Ended(): the rank
    that ended alone said it."""
    monkeypatch.setenv("RANK", "1")
    assert report(Ended("rank 1 ran out of memory", alone=True)) == 2
    assert capsys.readouterr().err == "[rank 1] error: rank 1 ran out of memory\n"
    monkeypatch.setenv("RANK", "0")
    assert report(Ended("rank 1 ran out of memory")) == 2
    assert capsys.readouterr().err == ""
    assert report(Ended("rank 0 ran out of memory", alone=True)) == 2
    assert capsys.readouterr().err == "error: rank 0 ran out of memory\n"


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


def test_a_batchnorm_on_one_value_per_channel_is_one_line_and_other_errors_are_not():
    import torch
    from app.errors import one_value_per_channel
    norm = torch.nn.BatchNorm2d(4).train()
    try:
        norm(torch.zeros(1, 4, 1, 1))
    except ValueError as e:
        said = str(one_value_per_channel(e))
    assert said.startswith("a BatchNorm layer cannot train on one value per channel (its input is [1, 4, 1, 1]): ")
    assert said.endswith("set train_micro_batch_size_per_gpu to 2 or more in the DeepSpeed config")
    assert norm(torch.zeros(2, 4, 1, 1)).shape == (2, 4, 1, 1)
    assert one_value_per_channel(ValueError("Expected more than 1 value")) is None


def test_the_batchnorm_line_names_the_input_size_where_the_compiler_wraps_the_error():
    from app.errors import one_value_per_channel
    wrapped = RuntimeError("Dynamo failed to run FX node: got ValueError('Expected more than 1 value per channel "
                           "when training, got input size torch.Size([1, 512, 1, 1])')")
    assert str(one_value_per_channel(wrapped)).startswith("a BatchNorm layer cannot train on one value per channel "
                                                          "(its input is [1, 512, 1, 1]): ")
