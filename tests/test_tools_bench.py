"""The benchmark entry point: one quick invocation measures every mode and writes complete JSON and a chart."""
import json

import pytest

from app.tools.bench import FIELDS
from conftest import BIN, run

ZERO_FIELDS = ("config", "stage", "parameters", "params_bytes", "grads_bytes", "optimizer_bytes",
               "master_copy_bytes", "measured_bytes", "formula_bytes", "measured_over_formula",
               "without_master_over_formula")


@pytest.mark.slow
def test_quick_benchmark_reports_every_field_for_every_mode(tmp_path):
    result = run([str(BIN / "python"), "-m", "app.tools.bench", "--quick", "--configs",
                  "dp,zero1,zero2,zero3,pipeline,activation_checkpointing", "--output_dir", tmp_path], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    modes = {(m["mode"], m["ranks"]): m for m in report["modes"]}
    assert set(modes) == {("raw", 1), ("raw-compile", 1), ("raw-1thread", 1), ("ddp", 2), ("pipeline", 2),
                          *((name, ranks) for name in ("dp", "zero1", "zero2", "zero3", "activation_checkpointing")
                            for ranks in (1, 2))}
    assert [s["mode"] for s in report["skipped"]] == ["dataparallel", "pipeline x1"], "no GPUs; 2 stages need 2"
    for key, mode in modes.items():
        assert tuple(mode) == FIELDS, key
        assert mode["step_time_s"] > 0 and mode["samples_per_s"] > 0 and 0 < mode["mfu"], key
        assert 0 <= mode["data_wait_share"] < 1 and mode["time_to_first_step_s"] > 0, key
        assert len(mode["peak_memory_bytes"]) == mode["ranks"] and min(mode["peak_memory_bytes"]) > 0, key
        assert (mode["scaling_efficiency"] is not None) == (mode["ranks"] == 2), key
        assert (mode["zero_state"] is not None) == (key[0] not in ("raw", "raw-compile", "raw-1thread", "ddp")), key
        assert mode["activation_checkpointing"] == (key[0] == "activation_checkpointing"), key
        assert len(mode["param_bytes"]) == mode["ranks"] and min(mode["param_bytes"]) > 0, key
        assert mode["global_batch"] == (16 if key[0] == "raw-1thread" else 32) and mode["speed_vs_one_device"] > 0, key
        # MFU against a matmul in the mode's own dtype; no datasheet peak for a CPU
        assert mode["dtype"] == "float32" and mode["mfu_datasheet"] is None, key
        assert mode["compiled"] == (key[0] == "raw-compile"), "--compile auto: the app runs eager on CPU"
        assert (mode["speed_vs_raw_compile"] is not None) == (key[1] == 1), key
    assert modes[("raw", 1)]["ratio_to_raw"] == 1.0 and modes[("ddp", 2)]["ratio_to_torch"] == 1.0
    assert modes[("raw-compile", 1)]["speed_vs_raw_compile"] == 1.0
    speed = modes[("raw-compile", 1)]["step_time_s"] / modes[("dp", 1)]["step_time_s"]
    assert f"headline (app speed / raw PyTorch + compile + fused AdamW, 1 rank): dp {speed:.3f}" in result.stdout
    for key in (("dp", 1), ("zero3", 1), ("dp", 2), ("zero3", 2)):
        zero = modes[key]["zero_state"]
        assert tuple(zero) == ZERO_FIELDS and zero["parameters"] == report["parameters"], key
    _the_plan_predicts_what_the_engine_holds(modes)
    # ZeRO-3 splits parameters across the two ranks; plain data parallel keeps all of them on each
    assert modes[("zero3", 2)]["zero_state"]["params_bytes"] < 0.6 * modes[("dp", 2)]["zero_state"]["params_bytes"]
    # the pipeline's two stages hold the model between them: each less than the whole, together all of it
    pipe, whole = modes[("pipeline", 2)], modes[("dp", 1)]
    assert pipe["pipeline_stages"] == 2 and pipe["micro_batch"] == 32, "2 ranks, 1 replica: the whole batch"
    assert max(pipe["param_bytes"]) < whole["param_bytes"][0] == sum(pipe["param_bytes"])
    assert "pipeline x2: " in result.stdout and "of its parameter bytes" in result.stdout
    assert "activation_checkpointing x1: activation checkpointing runs at " in result.stdout, "its cost, its saving"
    assert (tmp_path / "bench.png").stat().st_size > 1000
    assert "ddp" in result.stdout and "zero3" in result.stdout, "the table is printed"


def _the_plan_predicts_what_the_engine_holds(modes):
    """The memory plan's model states, from parameter sizes alone, against the tensors a real engine holds in a
    step (rank 0's), under ZeRO 0-3 on 1 and 2 ranks: within 5% for each kind and in all."""
    from app.ds import config as ds_config
    from app.core import models
    from app.memory import plan
    from app.data import DataInfo
    sizes = [p.numel() for p in models.build_model("cnn", DataInfo(10, 1, 8)).parameters()]
    kinds = {"params_bytes": "weights", "grads_bytes": "gradients", "optimizer_bytes": "optimizer",
             "master_copy_bytes": "masters"}
    for name in ("dp", "zero1", "zero2", "zero3"):
        ds = ds_config.load_ds_config(ds_config.REPO / "ds_configs" / f"{name}.json")
        for ranks in (1, 2):
            held = modes[(name, ranks)]["zero_state"]
            planned = plan.model_states(sizes, ds, ranks)[0]
            for measured, kind in kinds.items():
                assert planned[kind] == pytest.approx(held[measured], rel=0.05, abs=64), (name, ranks, kind)
            assert sum(planned.values()) == pytest.approx(held["measured_bytes"], rel=0.05), (name, ranks)


def test_a_bad_flag_is_one_line(capsys):
    from app.tools import bench
    assert bench.main(["--modes", "raw,fast"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --modes: unknown mode 'fast'; choose from raw, raw-compile, raw-1thread, ddp, dataparallel, app"]
    assert bench.main(["--compile", "on,maybe"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --compile takes a comma list of auto, on, off; got 'on,maybe'"]


def test_compile_choices_name_the_app_modes():
    """--compile off,on runs each config twice, eager and compiled, under names that say which."""
    from app.tools import bench
    args = bench.parse(["--modes", "app", "--configs", "zero1", "--compile", "off,on", "--ranks", "1"])
    groups, _ = bench.group_modes(args, cores=2, gpus=0)
    assert [mode for mode, _, _ in groups[1]] == ["zero1+eager", "zero1+compile"]


def test_ratios_and_the_headline():
    """Each mode against raw PyTorch and against torch at its own world size; scaling against one thread."""
    from app.tools.bench_report import add_ratios, headline
    rows = [{"mode": mode, "ranks": ranks, "step_time_s": step, "samples_per_s": rate}
            for mode, ranks, step, rate in [("raw", 1, 0.010, 3200.0), ("raw-compile", 1, 0.008, 4000.0),
                                            ("raw-1thread", 1, 0.012, 1000.0), ("ddp", 2, 0.020, 1600.0),
                                            ("dp", 1, 0.016, 2000.0), ("dp", 2, 0.025, 1500.0)]]
    add_ratios(rows)
    by = {(r["mode"], r["ranks"]): r for r in rows}
    assert by[("dp", 1)]["ratio_to_raw"] == pytest.approx(1.6) and by[("dp", 1)]["ratio_to_torch"] == pytest.approx(1.6)
    assert by[("dp", 2)]["ratio_to_torch"] == pytest.approx(1.25), "2 ranks compare with DDP, not the raw loop"
    assert by[("dp", 1)]["speed_vs_raw_compile"] == pytest.approx(0.5) and by[("dp", 2)]["speed_vs_raw_compile"] is None
    assert by[("dp", 2)]["scaling_efficiency"] == pytest.approx(1500 / (2 * 1000))
    assert by[("dp", 1)]["scaling_efficiency"] is None
    assert headline(rows) == "headline (app speed / raw PyTorch + compile + fused AdamW, 1 rank): dp 0.500"


def test_split_configs_run_where_the_ranks_hold_them():
    """A 2-way split skips 1 rank; at 2 ranks it is one replica, so each rank takes the whole global batch."""
    from app.tools import bench
    args = bench.parse(["--modes", "app", "--configs", "dp,pipeline", "--ranks", "2"])
    groups, skipped = bench.group_modes(args, cores=2, gpus=0)
    assert [(mode, batch) for mode, _, batch in groups[1]] == [("dp", 32)]
    assert [(mode, batch) for mode, _, batch in groups[2]] == [("dp", 16), ("pipeline", 32)]
    assert [mode for mode, _ in skipped] == ["pipeline x1"]


def test_the_splitting_line_compares_with_one_device():
    from app.tools.bench_report import add_ratios, splitting
    rows = [{"mode": mode, "ranks": ranks, "step_time_s": step, "samples_per_s": rate, "pipeline_stages": stages,
             "tensor_parallel": 1, "param_bytes": held, "peak_memory_bytes": peak}
            for mode, ranks, step, rate, stages, held, peak in [
                ("raw", 1, 0.010, 100.0, 1, [400], [1000]), ("dp", 1, 0.010, 100.0, 1, [400], [1000]),
                ("pipeline", 2, 0.0107, 93.0, 2, [180, 220], [500, 600])]]
    add_ratios(rows)
    assert rows[2]["speed_vs_one_device"] == pytest.approx(0.93)
    assert splitting(rows) == ["pipeline x2: 0.930x the speed of dp on one rank; per rank 55% of its parameter "
                               "bytes, 60% of its peak memory"]
