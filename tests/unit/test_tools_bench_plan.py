"""The memory plan beside the benchmark: each app row gets the peak the plan predicts for its config, world size and
micro batch, the same plan app.tools.plan prints (with --lora for a LoRA row); torch rows get none."""
import pytest
import torch

from app.core import resolver
from app.ds import auto as ds_auto
from app.ds import config as ds_config
from app.memory import planner
from app.tools import bench, bench_modes
from app.tools.bench_plan import add_planned_peaks

MB = 2**20


def _row(mode, ranks=1, micro=4, peak=100 * MB) -> dict:
    """A measured row with the fields the plan reads."""
    return {"mode": mode, "ranks": ranks, "micro_batch": micro, "peak_memory_bytes": [peak] * ranks}


def _configs(*names) -> dict:
    return {name: ds_config.load_ds_config(ds_config.REPO / "ds_configs" / f"{name}.json") for name in names}


def _planned(work, name: str, ranks: int, micro: int) -> int:
    """The plan's peak, as `python -m app.tools.plan` makes it: the config with its "auto" filled for the model on
    the device the benchmark ran on (CPU ranks persist no ZeRO-3 weight)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ds = ds_auto.fill(_configs(name)[name], resolver.auto_facts(work.task.spec, device), ranks)[0]
    counted = planner.workload(work.task, work.info.seq_len, work.info.image_size)
    return planner.plans(counted, {name: ds}, ranks)[name].peak(micro)


@pytest.mark.parametrize("model, flags", [("cnn", []), ("gpt2-tiny", ["--seq_len", "16"])])
def test_an_app_row_gets_the_plans_peak_for_its_config_ranks_and_micro_batch(model, flags):
    work = bench_modes.build_workload(bench.parse(["--quick", "--model", model, "--modes", "raw", *flags]))
    rows = [_row("zero1", micro=4), _row("zero3+eager", ranks=2, micro=2, peak=50 * MB)]
    lines = add_planned_peaks(rows, _configs("zero1", "zero3"), work)
    expected = [_planned(work, "zero1", 1, 4), _planned(work, "zero3", 2, 2)]
    assert [r["plan_peak_bytes"] for r in rows] == expected and min(expected) > 0
    assert [r["plan_over_peak"] for r in rows] == [pytest.approx(expected[0] / (100 * MB)),
                                                   pytest.approx(expected[1] / (50 * MB))]
    assert lines == [f"plan zero1 x1: {expected[0] / MB:.0f} MB planned, 100 MB measured, plan/peak "
                     f"{expected[0] / (100 * MB):.3f}",
                     f"plan zero3+eager x2: {expected[1] / MB:.0f} MB planned, 50 MB measured, plan/peak "
                     f"{expected[1] / (50 * MB):.3f}"]


def test_torch_and_unknown_rows_get_no_plan_and_a_row_without_a_peak_no_ratio():
    work = bench_modes.build_workload(bench.parse(["--quick", "--model", "gpt2-tiny", "--seq_len", "16",
                                                   "--modes", "raw"]))
    rows = [_row("raw"), _row("fsdp2", ranks=2), _row("ddp", ranks=2), _row("zero9"), _row("zero1", peak=0)]
    lines = add_planned_peaks(rows, _configs("zero1"), work)
    assert [(r["plan_peak_bytes"], r["plan_over_peak"]) for r in rows[:4]] == [(None, None)] * 4
    assert rows[4]["plan_peak_bytes"] == _planned(work, "zero1", 1, 4) and rows[4]["plan_over_peak"] is None
    assert lines == [], "no line for a row measured at 0 bytes"


def test_a_lora_row_is_planned_with_the_adapters_the_benchmark_gave_it():
    """As `python -m app.tools.plan --lora` plans it: the base frozen, the task's own rank and targets; a model
    that takes no adapters (the CNN) gets no plan for its LoRA row."""
    from app.core import lora
    work = bench_modes.build_workload(bench.parse(["--quick", "--model", "gpt2-tiny", "--seq_len", "16",
                                                   "--modes", "raw"]))
    bench_modes.build_model(work, lora=True)  # as the LoRA mode builds it
    rows = [_row("zero3+lora", ranks=2, micro=2), _row("zero3", ranks=2, micro=2)]
    add_planned_peaks(rows, _configs("zero3"), work)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ds = ds_auto.fill(_configs("zero3")["zero3"], resolver.auto_facts(work.task.spec, device), 2)[0]
    build = planner.workload(work.task, work.info.seq_len, work.info.image_size, frozen=True)
    adapters = (work.task.settings.lora_rank, lora.targets_of(work.task.settings))
    planned = planner.plans(build, {"zero3": ds}, 2, adapters)["zero3"]
    assert planned.trained < planned.parameters
    assert rows[0]["plan_peak_bytes"] == planned.peak(2) != rows[1]["plan_peak_bytes"]
    cnn = bench_modes.build_workload(bench.parse(["--quick", "--model", "cnn", "--modes", "raw"]))
    row = _row("zero1+lora")
    add_planned_peaks([row], _configs("zero1"), cnn)
    assert row["plan_peak_bytes"] is None


def test_an_offload_row_gets_what_the_plan_offloads_beside_the_hosts_measured_peak():
    """zero2_offload keeps on the host the optimizer's moments, the fp32 masters and their gradient, a copy of the
    weights' partition (20 bytes a parameter of the partition) and a staging buffer of the largest parameter: the
    row says it beside the process's measured peak; a row that offloads nothing says 0 and no line."""
    work = bench_modes.build_workload(bench.parse(["--quick", "--model", "gpt2-tiny", "--seq_len", "16",
                                                   "--modes", "raw"]))
    rows = [{**_row("zero2_offload", ranks=2), "host_peak_bytes": [900 * MB, 1000 * MB]},
            {**_row("zero1"), "host_peak_bytes": [900 * MB]}]
    lines = add_planned_peaks(rows, _configs("zero2_offload", "zero1"), work)
    sizes = [p.numel() for p in bench_modes.build_model(work).parameters()]
    expected = 20 * sum(sizes) // 2 + 4 * max(sizes)
    assert rows[0]["plan_host_bytes"] == expected and rows[1]["plan_host_bytes"] == 0
    assert lines[1] == f"plan host zero2_offload x2: {expected / MB:.0f} MB offloaded planned, host peak " \
                       f"1000 MB measured" and len(lines) == 3


def test_an_image_models_plan_is_the_benchmarks_model_of_its_classes_and_images():
    """resnet18 on the benchmark's 10 classes of 3x32x32 synthetic images: planned as that model, not as the
    1000-class one a plan without data takes."""
    from app.core.tasks import ImageClassification
    from app.data import Data
    from app.settings import Settings
    work = bench_modes.build_workload(bench.parse(["--quick", "--model", "resnet18", "--modes", "raw"]))
    assert (work.info.num_classes, work.info.in_channels, work.info.image_size) == (10, 3, 32)
    rows = [_row("zero1", micro=4)]
    add_planned_peaks(rows, _configs("zero1"), work)
    benchmarks = ImageClassification(Settings(model="resnet18"), Data(None, None, work.info))
    ds = ds_auto.fill(_configs("zero1")["zero1"], resolver.auto_facts(None), 1)[0]
    expected, without_data = (planner.plans(planner.workload(task, 0, 32), {"zero1": ds}, 1)["zero1"]
                              for task in (benchmarks, work.task))
    assert expected.parameters == 11_181_642 and without_data.parameters == 11_689_512
    assert rows[0]["plan_peak_bytes"] == expected.peak(4) != without_data.peak(4)
