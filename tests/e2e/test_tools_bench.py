"""The benchmark entry point: one quick invocation measures every mode and writes complete JSON and a chart."""
import json

import pytest

from app.tools.bench import FIELDS
from conftest import BIN, REPO, run

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
                          ("fsdp2", 1), ("fsdp2", 2),
                          *((name, ranks) for name in ("dp", "zero1", "zero2", "zero3", "activation_checkpointing")
                            for ranks in (1, 2))}
    assert [s["mode"] for s in report["skipped"]] == ["dataparallel", "pipeline x1"], "no GPUs; 2 stages need 2"
    for key, mode in modes.items():
        assert tuple(mode) == FIELDS, key
        assert mode["step_time_s"] > 0 and mode["samples_per_s"] > 0 and 0 < mode["mfu"], key
        assert 0 <= mode["data_wait_share"] < 1 and mode["time_to_first_step_s"] > 0, key
        assert len(mode["peak_memory_bytes"]) == mode["ranks"] and min(mode["peak_memory_bytes"]) > 0, key
        assert (mode["scaling_efficiency"] is not None) == (mode["ranks"] == 2), key
        torch_mode = key[0] in ("raw", "raw-compile", "raw-1thread", "ddp", "fsdp2")
        assert (mode["zero_state"] is not None) == (not torch_mode), key
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
    speed = modes[("fsdp2", 2)]["step_time_s"] / modes[("zero3", 2)]["step_time_s"]
    assert f"zero3 x2 {speed:.3f}" in next(line for line in result.stdout.splitlines() if line.startswith(
        "headline vs FSDP2 (app speed / torch FSDP2 at the same world size): dp x1 "))
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


def test_fsdp2_runs_beside_raw_on_one_rank_and_on_two_each_holding_its_shards(tmp_path):
    result = run([str(BIN / "python"), "-m", "app.tools.bench", "--model", "gpt2-tiny", "--modes", "raw,fsdp2",
                  "--ranks", "2", "--quick", "--seq_len", "32", "--output_dir", tmp_path], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    modes = {(m["mode"], m["ranks"]): m for m in report["modes"]}
    assert set(modes) == {("raw", 1), ("fsdp2", 1), ("fsdp2", 2)}
    one, two = modes[("fsdp2", 1)], modes[("fsdp2", 2)]
    assert (one["micro_batch"], two["micro_batch"], one["global_batch"], two["global_batch"]) == (16, 8, 16, 16)
    for mode in (one, two):
        assert tuple(mode) == FIELDS and mode["tokens_per_s"] > 0 and mode["zero_state"] is None
        assert mode["compiled"] is False and mode["dtype"] == "float32", "--compile auto: eager on CPU, as the app"
        assert mode["speed_vs_fsdp2"] == 1.0
    assert one["param_bytes"] == [report["parameters"] * 4], "one rank holds all of the fp32 model"
    assert sum(two["param_bytes"]) == one["param_bytes"][0] and max(two["param_bytes"]) < 0.6 * one["param_bytes"][0]
    assert "headline vs FSDP2" not in result.stdout, "no app mode to compare"


def _losses(rank, world, modes, report):
    """On every rank: each mode's loop (the raw loop on the whole model, or on the model FSDP2 shards) for 4 steps
    of gpt2-tiny on a global batch of 8 split over the ranks; rank 0 writes each step's loss, averaged over ranks."""
    from app.data.loader import build_loader
    from app.distributed import dist, launch
    from app.tools import bench, bench_fsdp, bench_modes, bench_torch
    args = bench.parse(["--model", "gpt2-tiny", "--modes", "raw", "--seq_len", "32", "--batch", "8", "--steps", "3",
                        "--warmup", "1", "--ranks", str(world)])  # before the group: DeepSpeed checks the config
    here = launch.setup(timeout_s=120)
    try:
        work, losses = bench_modes.build_workload(args), {}
        for mode in modes:
            model = bench_modes.build_model(work)
            if mode == "fsdp2":
                bench_fsdp.shard(model, here, compiled=False)
            loader = build_loader(work.train_set, 8 // world, here.rank, world, True, 0)
            steps = bench_torch.train(model, model, False, args, here, work, loader, bench_modes.Clock(here.device), 4)
            losses[mode] = [total / world for total in dist.host_sum([loss.item() for loss in steps])]
        if here.rank == 0:
            report.write_text(json.dumps(losses))
    finally:
        dist.teardown()


def test_fsdp2_trains_the_raw_loops_losses_on_one_rank_and_on_two(tmp_path):
    """FSDP2's shards gather, reduce and step to the very model the raw loop trains (fp32, gradients clipped)."""
    from conftest import spawn_ranks
    spawn_ranks(1, _losses, ["raw", "fsdp2"], tmp_path / "one.json")
    spawn_ranks(2, _losses, ["fsdp2"], tmp_path / "two.json")
    one, two = (json.loads((tmp_path / name).read_text()) for name in ("one.json", "two.json"))
    assert len(one["raw"]) == 4 and one["raw"][0] > one["raw"][-1], "it learns"
    assert one["fsdp2"] == pytest.approx(one["raw"], abs=1e-5) and two["fsdp2"] == pytest.approx(one["raw"], abs=1e-5)


def _engine_left(rank, world, report):
    """Whether a ZeRO-3 engine that trained 3 steps outlives its destroy(), then the bench's forget_engines()."""
    import gc
    import weakref
    import torch
    from app.distributed import dist, launch
    from app.tools.bench_modes import forget_engines
    from conftest import engine_of
    launch.setup(timeout_s=60)
    try:
        ds = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
        ds.pop("scheduler")  # its steps come from a run's length
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
        engine = engine_of(model, ds)
        for _ in range(3):
            engine.backward(engine(torch.randn(4, 8)).float().sum())
            engine.step()
        engine.destroy()
        left = weakref.ref(engine)
        del engine, model
        gc.collect()
        kept = left() is not None
        forget_engines()
        gc.collect()
        report.write_text(json.dumps([kept, left() is not None]))
    finally:
        dist.teardown()


def test_a_zero3_mode_leaves_nothing_of_its_engine_to_the_next(tmp_path):
    """DeepSpeed's parameter coordinator caches, on its class, which parameters to release after each submodule
    from the second step on, and so keeps a destroyed ZeRO-3 engine whole (on an H200 a llama-1b engine's 24.7 GB
    stayed in the peaks of the benchmark's modes after it). The bench forgets it after each mode."""
    from conftest import spawn_ranks
    spawn_ranks(1, _engine_left, tmp_path / "left.json")
    kept, left = json.loads((tmp_path / "left.json").read_text())
    assert kept, "DeepSpeed no longer keeps a destroyed ZeRO-3 engine: ds_internals.forget_released_params can go"
    assert not left, "the engine outlives forget_engines()"


def _modes_after(rank, world, report):
    """The lines of the bench's modes zero3 then dp, twice: the second time with zero3's engine held from outside."""
    import contextlib
    import io
    from app.distributed import dist, launch
    from app.tools import bench, bench_modes
    args = bench.parse(["--model", "gpt2-tiny", "--modes", "app", "--configs", "zero3,dp", "--seq_len", "32",
                        "--batch", "4", "--steps", "2", "--warmup", "1", "--ranks", "1", "--quick"])
    args.flops_per_sample, args.lora_flops_per_sample = 1.0, False  # as bench.main counts them, in its process
    here = launch.setup(timeout_s=120)
    held, build = [], bench_modes.loop.build_engine

    def holding(*a, **kw):
        held.append(build(*a, **kw))
        return held[-1]
    try:
        work, said = bench_modes.build_workload(args), []
        for builds in (build, holding):
            bench_modes.loop.build_engine = builds
            for mode in ("zero3", "dp"):
                with contextlib.redirect_stdout(io.StringIO()) as out:
                    bench_modes.measure(mode, args, here, 1, 4, work)
                said.append([line for line in out.getvalue().splitlines() if line.startswith("held ")])
            held.clear()
        report.write_text(json.dumps(said))
    finally:
        bench_modes.loop.build_engine = build
        dist.teardown()


def test_a_mode_says_when_an_earlier_modes_engine_is_still_held(tmp_path):
    """Each mode starts as in a process of its own: the ZeRO-3 mode's engine is gone when dp starts; where
    something the bench does not know keeps it (here the test), dp's start says so, as its peak includes it."""
    from conftest import spawn_ranks
    spawn_ranks(1, _modes_after, tmp_path / "said.json")
    said = json.loads((tmp_path / "said.json").read_text())
    assert said[:2] == [[], []], "nothing held"
    assert said[2] == [] and said[3] == ["held dp: the engine of zero3 is still alive (a reference forget_engines "
                                         "does not clear); this mode's peak memory includes it"]


def test_a_mode_that_fails_is_reported_and_the_next_mode_runs_profiled(tmp_path):
    """An optimizer DeepSpeed does not have passes the app's check of the file (DeepSpeed's own types are its to
    say) and fails in deepspeed.initialize, inside its mode: a row that says why, then zero3 runs, profiled."""
    broken = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    broken["optimizer"]["type"] = "NoSuchOptimizer"
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    out = tmp_path / "out"
    result = run([str(BIN / "python"), "-m", "app.tools.bench", "--model", "gpt2-tiny", "--ranks", "1", "--modes",
                  "raw,app", "--configs", f"{tmp_path / 'broken.json'},zero3", "--seq_len", "32", "--quick",
                  "--profile", "zero3", "--output_dir", out], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    measured = [line.split(":")[0] for line in lines if line.startswith("measured ")]
    assert measured == ["measured raw x1", "measured broken x1", "measured zero3 x1"], "the next mode runs"
    report = json.loads((out / "bench.json").read_text())
    assert [(r["mode"], r["ranks"]) for r in report["failed"]] == [("broken", 1)]
    why = report["failed"][0]["failed"]
    assert "NoSuchOptimizer is not a supported DeepSpeed Optimizer" in why, why
    assert f"failed broken x1: {why}" in lines
    assert [m["mode"] for m in report["modes"]] == ["raw", "zero3"]
    for mode in report["modes"]:
        assert tuple(mode) == FIELDS and mode["host_peak_bytes"][0] > 0 and mode["graphs"] == [0, 0], mode["mode"]
    assert (report["modes"][0]["plan_peak_bytes"], report["modes"][1]["plan_peak_bytes"] > 0) == (None, True)
    summary = next(line for line in lines if line.startswith("profile zero3: "))
    assert " ms a step wall, device busy 0.0 ms (0%)" in summary, "no device on a CPU"
    assert (out / "profile-zero3.txt").read_text().splitlines()[0] == summary
    assert not any(line.startswith("profile raw") for line in lines), "--profile names zero3 alone"
    kept = json.loads((out / "rows-1-ranks.json").read_text())
    assert [(r["mode"], "failed" in r) for r in kept] == [("raw", False), ("broken", True), ("zero3", False)]


def test_a_benchmark_run_without_its_plan_is_planned_later_from_its_folder(tmp_path):
    """--plan off: the rows without a plan, as the GPU check runs it; app.tools.bench_replan then plans them from
    the folder alone, its config's file gone (on the GPU machine), as the benchmark would have."""
    mine = tmp_path / "mine.json"
    mine.write_text((REPO / "ds_configs" / "zero2.json").read_text())
    out = tmp_path / "out"
    result = run([str(BIN / "python"), "-m", "app.tools.bench", "--model", "gpt2-tiny", "--ranks", "1", "--modes",
                  "app", "--configs", mine, "--seq_len", "32", "--quick", "--plan", "off", "--output_dir", out],
                 timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert not [line for line in result.stdout.splitlines() if line.startswith("plan ")]
    measured = json.loads((out / "bench.json").read_text())["modes"][0]
    assert measured["plan_peak_bytes"] is None
    mine.unlink()
    later = run([str(BIN / "python"), "-m", "app.tools.bench_replan", out], timeout=300)
    assert later.returncode == 0, later.stdout[-3000:] + later.stderr[-3000:]
    planned = json.loads((out / "plan.json").read_text())
    assert [(r["mode"], r["ranks"], r["peak_memory_bytes"]) for r in planned] == \
        [("mine", 1, measured["peak_memory_bytes"])]
    peak = planned[0]["plan_peak_bytes"]
    assert peak > 0 and planned[0]["plan_over_peak"] == peak / measured["peak_memory_bytes"][0]
    assert f"plan mine x1: {peak / 2**20:.0f} MB planned" in later.stdout
