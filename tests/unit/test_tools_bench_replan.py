"""app.tools.bench_replan: the plan of a benchmark's rows made later, on another machine, from what the benchmark
left in its folder; the same plan the benchmark itself would have printed on the device the rows ran on."""
import json

import pytest

from app.core import resolver
from app.ds import auto as ds_auto
from app.ds import config as ds_config
from app.errors import UserError
from app.memory import planner
from app.tools import bench, bench_modes, bench_replan

MB = 2**20
ARGV = ["--model", "gpt2-tiny", "--seq_len", "16", "--batch", "4", "--ranks", "2", "--modes", "raw,app", "--quick"]


def _left(folder, configs: dict, device: str, rows: list):
    """A benchmark's folder as one that ran on device leaves it: its flags (with paths of that machine), its
    configs, the rows its modes kept."""
    argv = [*ARGV, "--config", "/elsewhere/mine.json", "--output_d=/elsewhere/out"]  # argparse's abbreviations
    (folder / bench.SETUP).write_text(json.dumps({"argv": argv, "device": device, "configs": configs}))
    (folder / "rows-2-ranks.json").write_text(json.dumps(rows))


def _planned(name: str, ds: dict, device: str, ranks: int, micro: int) -> int:
    work = bench_modes.build_workload(bench.parse(ARGV))
    filled = ds_auto.fill(ds, resolver.auto_facts(work.task.spec, device), ranks)[0]
    return planner.plans(planner.workload(work.task, 16), {name: filled}, ranks)[name].peak(micro)


def test_rows_measured_on_a_gpu_are_planned_here_as_on_the_gpu(tmp_path):
    """The configs come from the folder (their files were on the other machine) and their "auto" is filled for
    the rows' device: ZeRO-3's persistence differs between CPU ranks and GPU ranks."""
    mine = ds_config.load_ds_config(ds_config.REPO / "ds_configs" / "zero3.json")
    rows = [{"mode": "raw", "ranks": 1, "micro_batch": 4, "peak_memory_bytes": [90 * MB]},
            {"mode": "mine", "ranks": 2, "micro_batch": 2, "compiled": False, "peak_memory_bytes": [50 * MB] * 2},
            {"mode": "mine", "ranks": 2, "failed": "OutOfMemoryError: CUDA out of memory"}]
    _left(tmp_path, {"mine": mine}, "cuda", rows)
    lines = bench_replan.replan(tmp_path)
    on_gpu, on_cpu = (_planned("mine", mine, device, 2, 2) for device in ("cuda", "cpu"))
    assert on_gpu != on_cpu, "the case must tell the devices apart"
    assert lines == [f"plan mine x2: {on_gpu / MB:.0f} MB planned, 50 MB measured, plan/peak "
                     f"{on_gpu / (50 * MB):.3f}"]
    planned = json.loads((tmp_path / "plan.json").read_text())
    assert [(r["mode"], r["plan_peak_bytes"]) for r in planned] == [("mine", on_gpu)]
    assert planned[0]["plan_over_peak"] == pytest.approx(on_gpu / (50 * MB))


def test_a_folder_no_benchmark_left_is_one_line(tmp_path, capsys):
    assert bench_replan.main([str(tmp_path)]) == 2
    assert f"{tmp_path} holds no bench-args.json" in capsys.readouterr().err
    with pytest.raises(UserError):
        bench_replan.replan(tmp_path / "missing")


def test_a_benchmark_starting_in_a_folder_drops_the_rows_an_earlier_one_left(tmp_path):
    """The rows of another run there (other ranks, other configs) would be planned with this run's flags."""
    (tmp_path / "rows-4-ranks.json").write_text("[]")
    bench.write_setup(tmp_path, ["--quick"], {})
    assert not list(tmp_path.glob("rows-*")) and json.loads((tmp_path / bench.SETUP).read_text())["argv"] == ["--quick"]
