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


def _steps(recorder, done: range, each_evaluated=False):
    """The loop's order: at(steps done) before the first step, then each step, its evaluation, at(step)."""
    x = torch.randn(64, 64)
    recorder.at(done.start)
    for step in range(done.start + 1, done.stop + 1):
        with torch.profiler.record_function(f"step {step}"):
            x = (x @ x).tanh()
        if each_evaluated:
            with torch.profiler.record_function(f"eval after step {step}"):
                x = x.tanh()
        recorder.at(step)


def _recorded(path) -> set:
    return {e["name"] for e in json.loads(path.read_text())["traceEvents"] if "step " in e.get("name", "")}


def test_a_trace_holds_the_steps_asked_for_and_no_others(tmp_path, capsys):
    """Each step with its own evaluation (and save), not the one before's."""
    path = tmp_path / "profile" / "rank0.steps2-3.pt.trace.json"
    recorder = profiler.StepProfiler(2, 3, path, cuda=False)
    _steps(recorder, range(0, 5), each_evaluated=True)
    events = json.loads(path.read_text())["traceEvents"]
    assert _recorded(path) == {"step 2", "eval after step 2", "step 3", "eval after step 3"}
    assert any(e.get("name") == "aten::mm" for e in events)
    assert f"profile: steps 2-3 written to {path}" in capsys.readouterr().out


def test_a_run_that_ends_inside_the_steps_writes_those_it_took_and_one_that_misses_them_says_so(tmp_path, capsys):
    """Stopped early (--early_stopping_patience, a stop request) at step 3 of 2-5: steps 2-3 are written, named so;
    a run that ends (or had resumed) outside the steps records nothing and says it."""
    recorder = profiler.StepProfiler(2, 5, tmp_path / "profile" / "rank0.steps2-5.pt.trace.json", cuda=False)
    _steps(recorder, range(0, 3))
    recorder.finish(3)
    path = tmp_path / "profile" / "rank0.steps2-3.pt.trace.json"
    assert _recorded(path) == {"step 2", "step 3"} and f"profile: steps 2-3 written to {path}" in \
        capsys.readouterr().out
    recorder.finish(3)
    assert capsys.readouterr().out == "", "written once"
    late = profiler.StepProfiler(2, 5, tmp_path / "late" / "rank0.steps2-5.pt.trace.json", cuda=False)
    late.at(7)
    late.finish(9)
    assert capsys.readouterr().out == ("profile: nothing recorded: this run, ended at step 9, took none of steps "
                                       "2-5 (it resumed after them or ended before them)\n")
    assert not (tmp_path / "late").exists()


def test_a_run_resumed_inside_the_steps_names_the_ones_it_recorded(tmp_path, capsys):
    """--profile 5:8 resumed at step 6: steps 7-8 are recorded, and the file and the line say 7-8."""
    recorder = profiler.StepProfiler(5, 8, tmp_path / "profile" / "rank0.steps5-8.pt.trace.json", cuda=False)
    _steps(recorder, range(6, 9))
    path = tmp_path / "profile" / "rank0.steps7-8.pt.trace.json"
    assert _recorded(path) == {"step 7", "step 8"} and f"profile: steps 7-8 written to {path}" in \
        capsys.readouterr().out
    assert [p.name for p in (tmp_path / "profile").iterdir()] == [path.name]
