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


def test_a_restart_keeps_the_commands_own_resume_until_the_run_saved_a_checkpoint(tmp_path, capsys):
    """Started from another run's checkpoint, a run that crashes before its first save starts from it again (not
    afresh, as --resume auto in its empty folder would); once it saved one, it continues from its own. A
    checkpoint in the folder before the command started (a timeline it drops) is not its own."""
    out = tmp_path / "b"
    (out / "checkpoints" / "step00000009").mkdir(parents=True)
    (out / "checkpoints" / "step00000009" / "manifest.json").write_text("{}")  # the timeline it rolls back from
    log = tmp_path / "argv"
    script = (f"import pathlib, sys; log = pathlib.Path({str(log)!r}); runs = log.read_text().count('\\n') "
              f"if log.exists() else 0; log.write_text((log.read_text() if log.exists() else '') + "
              f"' '.join(sys.argv[1:]) + '\\n'); saved = pathlib.Path({str(out)!r}) / 'checkpoints' / 'step00000003'; "
              f"runs == 1 and (saved.mkdir(), (saved / 'manifest.json').write_text('{{}}')); sys.exit(1)")
    command = [sys.executable, "-c", script, "--output_dir", str(out), "--resume", "runs/a/checkpoints/step00000200"]
    assert restart.main(["--max_restarts", "2", "--wait", "0", "--", *command]) == 1
    assert log.read_text().splitlines() == [
        f"--output_dir {out} --resume runs/a/checkpoints/step00000200",  # the first run, as given
        f"--output_dir {out} --resume runs/a/checkpoints/step00000200 --overwrite",  # no save yet: as given, over
        # what the crashed attempt left (its metrics.csv)
        f"--output_dir {out} --resume auto"]  # it saved step 3: from there
    said = capsys.readouterr().out
    assert "running it again from where it started (it saved no checkpoint) (1 of 2" in said
    assert "running it again from its last checkpoint (2 of 2" in said


def test_a_signal_to_the_tool_goes_on_to_the_run_and_nothing_runs_after_it(tmp_path):
    """As torchrun's agent: SIGTERM to the tool reaches the run, which saves and exits 0, and no attempt follows."""
    import signal
    import subprocess
    import time
    ready, done, runs = tmp_path / "ready", tmp_path / "saved", tmp_path / "runs"
    script = (f"import pathlib, signal, sys, time; r = pathlib.Path({str(runs)!r}); "
              f"r.write_text((r.read_text() if r.exists() else '') + 'x'); "
              f"signal.signal(signal.SIGTERM, lambda *_: (pathlib.Path({str(done)!r}).write_text('1'), sys.exit(0))); "
              f"pathlib.Path({str(ready)!r}).write_text('1'); time.sleep(60); sys.exit(1)")
    tool = subprocess.Popen([sys.executable, "-m", "app.tools.restart", "--max_restarts", "2", "--wait", "0", "--",
                             sys.executable, "-c", script, "--output_dir", str(tmp_path / "out")])
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    tool.send_signal(signal.SIGTERM)
    assert tool.wait(timeout=60) == 0 and done.read_text() == "1" and runs.read_text() == "x"
