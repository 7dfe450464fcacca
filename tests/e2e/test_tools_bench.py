"""The benchmark entry point: one quick invocation measures every mode and writes complete JSON and a chart."""
import json

import pytest

from app.tools.bench import FIELDS
from conftest import BIN, run

ZERO_FIELDS = ("config", "stage", "parameters", "params_bytes", "grads_bytes", "optimizer_bytes",
               "master_copy_bytes", "measured_bytes", "formula_bytes", "measured_over_formula",
               "without_master_over_formula")


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
    from app.memory import estimate
    from app.data import DataInfo
    sizes = [p.numel() for p in models.build_model("cnn", DataInfo(10, 1, 8)).parameters()]
    kinds = {"params_bytes": "weights", "grads_bytes": "gradients", "optimizer_bytes": "optimizer",
             "master_copy_bytes": "masters"}
    for name in ("dp", "zero1", "zero2", "zero3"):
        ds = ds_config.load_ds_config(ds_config.REPO / "ds_configs" / f"{name}.json")
        for ranks in (1, 2):
            held = modes[(name, ranks)]["zero_state"]
            planned = estimate.model_states(sizes, ds, ranks)[0]
            for measured, kind in kinds.items():
                assert planned[kind] == pytest.approx(held[measured], rel=0.05, abs=64), (name, ranks, kind)
            assert sum(planned.values()) == pytest.approx(held["measured_bytes"], rel=0.05), (name, ranks)
