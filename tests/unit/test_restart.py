"""The restart tool: the command it runs again (with --resume auto, which needs --output_dir) and when it stops
(success, a user's error, its last restart). Killed runs restarted for real: tests/e2e/test_restart.py."""
import sys

import pytest

from app.errors import UserError
from app.tools import restart


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
