"""--profile (app/observe/profiler.py): the steps asked for, one line for a mistake, and a trace of exactly those
steps that Perfetto and TensorBoard read (Chrome's trace format)."""
import json

import pytest
import torch

from app.errors import UserError
from app.observe import profiler


def test_the_steps_are_first_to_last_and_a_mistake_is_one_line():
    assert profiler.steps_of("") == () and profiler.steps_of("5:8") == (5, 8) and profiler.steps_of("3") == (3, 3)
    for wrong in ("0:2", "4:2", "a:b", "5-8"):
        with pytest.raises(UserError, match="give the optimizer steps to record as FIRST:LAST"):
            profiler.steps_of(wrong)


def test_a_trace_holds_the_steps_asked_for_and_no_others(tmp_path, capsys):
    path = tmp_path / "profile" / "rank0.steps2-3.pt.trace.json"
    recorder = profiler.StepProfiler(2, 3, path, cuda=False)
    x = torch.randn(64, 64)
    for done in range(5):
        recorder.at(done)
        with torch.profiler.record_function(f"step {done + 1}"):
            x = (x @ x).tanh()
    events = json.loads(path.read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("step ")}
    assert steps == {"step 2", "step 3"}
    assert any(e.get("name") == "aten::mm" for e in events)
    assert f"profile: steps 2-3 written to {path}" in capsys.readouterr().out


def test_a_run_that_ends_inside_the_steps_writes_those_it_took_and_one_that_misses_them_says_so(tmp_path, capsys):
    """Stopped early (--early_stopping_patience, a stop request) at step 3 of 2-5: steps 2-3 are written, named so;
    a run that ends (or had resumed) outside the steps records nothing and says it."""
    recorder = profiler.StepProfiler(2, 5, tmp_path / "profile" / "rank0.steps2-5.pt.trace.json", cuda=False)
    x = torch.randn(32, 32)
    for done in range(3):
        recorder.at(done)
        with torch.profiler.record_function(f"step {done + 1}"):
            x = (x @ x).tanh()
    recorder.finish(3)
    path = tmp_path / "profile" / "rank0.steps2-3.pt.trace.json"
    steps = {e["name"] for e in json.loads(path.read_text())["traceEvents"] if e.get("name", "").startswith("step ")}
    assert steps == {"step 2", "step 3"} and f"profile: steps 2-3 written to {path}" in capsys.readouterr().out
    recorder.finish(3)
    assert capsys.readouterr().out == "", "written once"
    late = profiler.StepProfiler(2, 5, tmp_path / "late" / "rank0.steps2-5.pt.trace.json", cuda=False)
    late.at(7)
    late.finish(9)
    assert capsys.readouterr().out == ("profile: nothing recorded: this run, ended at step 9, took none of steps "
                                       "2-5 (it resumed after them or ended before them)\n")
    assert not (tmp_path / "late").exists()
