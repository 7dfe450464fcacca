"""The GPU check's own plumbing (scripts/gpu_check.sh, scripts/gpu_check.py), on a machine without a GPU: every part
says it needs one and the report is still written; a part that runs past its limit or fails does not stop the rest."""
import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import REPO


def _driver():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_a_gpu_every_part_says_it_needs_one_and_the_report_is_written(tmp_path):
    result = subprocess.run(["bash", "scripts/gpu_check.sh", tmp_path / "out"], cwd=REPO, capture_output=True,
                            text=True, timeout=300, env={"PATH": f"{REPO / '.venv' / 'bin'}:/usr/bin:/bin",
                                                         "PYTHON": sys.executable})
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    names = [part.name for part in _driver().parts(tmp_path)]
    assert report["cuda"] is False and list(report["parts"]) == names
    assert all(part["status"] == "needs a CUDA GPU" for part in report["parts"].values())
    assert result.stdout.splitlines()[0].split()[:3] == ["part", "status", "seconds"]
    assert [line.split()[0] for line in result.stdout.splitlines()[1:]] == names


def test_a_part_past_its_limit_is_ended_and_the_next_still_runs(tmp_path, monkeypatch):
    """Fake parts through the driver as if on a GPU: one sleeps past its limit, one fails, one writes a figure, one
    runs pytest whose tests all skip here (tests/e2e/test_cuda.py needs CUDA)."""
    gpu_check = _driver()
    figure = f"open('{tmp_path}/out/' + 'writes.figures', 'a').write('ratio 0.97\\n')"
    fake = [gpu_check.Part("sleeps", 2, ["sleep", "30"], "past its limit"),
            gpu_check.Part("fails", 10, [sys.executable, "-c", "raise SystemExit(3)"], "exits 3"),
            gpu_check.Part("writes", 10, [sys.executable, "-c", f"{figure}; print('headline (app speed): dp 0.97'); "
                                                 f"print('held dp: the engine of zero3 is still alive')"],
                           "a figure, a headline and a mode's start that found an earlier engine"),
            gpu_check.Part("skips", 60, gpu_check.cuda_test("plan_predicts"), "pytest, every test skipped")]
    monkeypatch.setattr(gpu_check, "parts", lambda out: fake)
    monkeypatch.setattr(gpu_check, "cuda_available", lambda: True)
    assert gpu_check.main([str(tmp_path / "out"), "--limit", "writes=5"]) == 1
    parts = json.loads((tmp_path / "out" / "report.json").read_text())["parts"]
    assert parts["sleeps"]["status"] == "timed out" and parts["sleeps"]["seconds"] < 10
    assert parts["fails"]["status"] == "failed (exit 3)"
    assert parts["writes"]["status"] == "passed"
    assert parts["writes"]["figures"] == {"ratio": "0.97", "headline (app speed)": "headline (app speed): dp 0.97",
                                          "held dp": "held dp: the engine of zero3 is still alive"}
    assert parts["skips"]["status"] == "no test passed"
    assert parts["skips"]["tests"] == {"SKIPPED": ["test_the_plan_predicts_the_peak_the_gpu_reaches"]}


def test_a_part_takes_the_limit_it_is_given_and_a_misspelled_part_is_refused(tmp_path, monkeypatch, capsys):
    gpu_check = _driver()
    monkeypatch.setattr(gpu_check, "parts", lambda out: [gpu_check.Part("sleeps", 60, ["sleep", "30"], "sleeps")])
    monkeypatch.setattr(gpu_check, "cuda_available", lambda: True)
    assert gpu_check.main([str(tmp_path / "out"), "--limit", "sleeps=1"]) == 1
    part = json.loads((tmp_path / "out" / "report.json").read_text())["parts"]["sleeps"]
    assert part["status"] == "timed out" and part["seconds"] < 10
    with pytest.raises(SystemExit) as refused:
        gpu_check.main([str(tmp_path / "out"), "--limit", "sleep=1"])
    assert refused.value.code == 2
    assert "--limit or --only names no part: sleep" in capsys.readouterr().err


def test_only_runs_the_parts_it_names_in_the_order_it_names_them(tmp_path, monkeypatch):
    gpu_check = _driver()
    fake = [gpu_check.Part(name, 10, ["true"], name) for name in ("first", "second", "third")]
    monkeypatch.setattr(gpu_check, "parts", lambda out: fake)
    monkeypatch.setattr(gpu_check, "cuda_available", lambda: True)
    assert gpu_check.main([str(tmp_path / "out"), "--only", "third, first,third,"]) == 0
    assert list(json.loads((tmp_path / "out" / "report.json").read_text())["parts"]) == ["third", "first"]
    with pytest.raises(SystemExit):
        gpu_check.main([str(tmp_path / "out"), "--only", "third,fourth"])


def test_the_zero3_variants_are_configs_the_app_takes_each_one_setting_apart(tmp_path):
    """The rows that say what each of DeepSpeed's ZeRO-3 settings buys: zero3.json as shipped but for that one."""
    from app.ds import config as ds_config
    shipped = json.loads((REPO / "ds_configs" / "zero3.json").read_text())["zero_optimization"]
    files = {name: ds_config.load_ds_config(path, resolve=False) for name, path in
             _driver().zero3_variants(tmp_path).items()}
    variants = {name: ds["zero_optimization"] for name, ds in files.items()}
    assert variants["zero3-deepcompile"] == shipped and files["zero3-deepcompile"]["compile"] == {"deepcompile": True}
    assert all("compile" not in ds for name, ds in files.items() if name != "zero3-deepcompile")
    assert variants["zero3-stock"] == {"stage": 3, "overlap_comm": True, "contiguous_gradients": True}
    assert variants["zero3-nomel"] == {**shipped, "memory_efficient_linear": False}
    unpersisted = {k: v for k, v in shipped.items() if "persistence" not in k}
    assert {k: v for k, v in variants["zero3-persist"].items() if "persistence" not in k} == unpersisted
    assert variants["zero3-persist"]["stage3_param_persistence_threshold"] == 10**10


def test_each_parts_benchmark_takes_its_flags_and_leaves_its_plan_to_a_cpu(tmp_path):
    """A misspelled flag in a part would cost a GPU session that part: each bench command of the check parses here,
    names a model the app builds, profiles modes it runs on one GPU, plans nothing on the device (--plan off) and
    writes its rows where the check's last line sends app.tools.bench_replan."""
    from app.core import models
    from app.tools import bench
    gpu_check = _driver()
    commands = [part.command for part in gpu_check.parts(tmp_path) if part.command[1:3] == ["-m", "app.tools.bench"]]
    for command in commands:
        args = bench.parse(command[3:])
        assert args.model in models.PRESETS or args.model in models.BUILTIN, command
        assert args.plan == "off" and args.output_dir.parent == tmp_path, command
        assert args.output_dir.name in gpu_check.BENCHES, command
        bench._check_profiled(args.profile, bench.group_modes(args, 16, 1)[0])  # as on a machine with one GPU
    assert len(commands) == len(gpu_check.BENCHES)


def test_the_last_line_says_how_to_plan_the_benchmarks_rows(tmp_path, monkeypatch, capsys):
    """A benchmark part that ran (its folder has its bench-args.json, however it ended) is named in the command
    that plans its rows afterwards; one that did not run is not."""
    gpu_check = _driver()
    out = tmp_path / "out"
    leaves = f"import pathlib; d = pathlib.Path('{out}/llama-1b'); d.mkdir(); (d / 'bench-args.json').write_text('{{}}')"
    monkeypatch.setattr(gpu_check, "parts", lambda out: [gpu_check.Part("bench", 10, [sys.executable, "-c", leaves],
                                                                         "leaves a benchmark's folder")])
    monkeypatch.setattr(gpu_check, "cuda_available", lambda: True)
    assert gpu_check.main([str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == \
        f"the plan of the benchmarks' rows, on any machine: python -m app.tools.bench_replan {out / 'llama-1b'}"


def test_the_bf16_weights_configs_are_the_shipped_ones_with_deepspeeds_bf16_section(tmp_path):
    from app.ds import config as ds_config
    for name, path in _driver().bf16_weights(tmp_path).items():
        shipped = json.loads((REPO / "ds_configs" / f"{name}.json").read_text())
        written = ds_config.load_ds_config(path, resolve=False)
        assert "torch_autocast" in shipped and "torch_autocast" not in written, name
        assert written == {**{k: v for k, v in shipped.items() if k != "torch_autocast"}, "bf16": {"enabled": True}}


def test_the_budget_counts_from_the_scripts_start_its_install_included(tmp_path, monkeypatch):
    """gpu_check.sh marks its start before it installs the wheels; a check started 535 s before the driver, on a
    budget of 540 s, has no time left for a part."""
    import time
    gpu_check = _driver()
    monkeypatch.setattr(gpu_check, "parts", lambda out: [gpu_check.Part("first", 10, ["true"], "first")])
    monkeypatch.setattr(gpu_check, "cuda_available", lambda: True)
    monkeypatch.setenv("GPU_CHECK_STARTED", str(time.time() - 535))
    assert gpu_check.main([str(tmp_path / "out")]) == 1
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["parts"]["first"]["status"] == "not run: no time left" and report["seconds"] >= 535
    monkeypatch.setenv("GPU_CHECK_STARTED", str(time.time()))
    assert gpu_check.main([str(tmp_path / "again")]) == 0
