"""The benchmark's parts: its flags, the app modes' compile choices, ratios and the headline, where split configs
run, and the line that compares splitting with one device. One quick invocation: tests/e2e/test_tools_bench.py."""
import pytest


def test_a_bad_flag_is_one_line(capsys):
    from app.tools import bench
    assert bench.main(["--modes", "raw,fast"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --modes: unknown mode 'fast'; choose from raw, raw-compile, raw-1thread, ddp, dataparallel, fsdp2, app"]
    assert bench.main(["--compile", "on,maybe"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --compile takes a comma list of auto, on, off; got 'on,maybe'"]
    assert bench.main(["--model", "gpt2-tiny", "--lora", "maybe"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --lora takes nothing (= both), both or only; got 'maybe'"]
    assert bench.main(["--model", "cnn", "--modes", "raw,app", "--configs", "zero3", "--ranks", "1",
                       "--profile", "zero2"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --profile: no mode 'zero2' runs here; the modes are raw, zero3"]


def test_a_configs_entry_is_a_ds_configs_name_or_the_path_of_a_json_or_accelerate_file(tmp_path):
    from app.tools import bench
    from conftest import REPO
    assert bench._config_path("zero3") == REPO / "ds_configs" / "zero3.json"
    assert bench._config_path(str(tmp_path / "mine.json")) == tmp_path / "mine.json"
    (tmp_path / "mine.json").write_text((REPO / "ds_configs" / "zero1.json").read_text())
    args = bench.parse(["--modes", "app", "--configs", f"dp,{tmp_path / 'mine.json'}", "--ranks", "1"])
    assert list(args.configs) == ["dp", "mine"], "the file's stem names its mode"
    assert args.configs["mine"]["zero_optimization"]["stage"] == 1
    trl = REPO / "tests" / "data" / "accelerate" / "trl-deepspeed_zero2.yaml"
    args = bench.parse(["--modes", "app", "--configs", str(trl), "--ranks", "1"])
    assert args.configs["trl-deepspeed_zero2"]["zero_optimization"]["stage"] == 2


@pytest.mark.parametrize("flag, modes", [([], ["dp", "zero1"]), (["--lora"], ["dp", "dp+lora", "zero1", "zero1+lora"]),
                                         (["--lora", "only"], ["dp+lora", "zero1+lora"])])
def test_lora_runs_each_app_mode_beside_the_whole_model_or_alone(flag, modes):
    from app.tools import bench
    args = bench.parse(["--model", "gpt2-tiny", "--modes", "app", "--configs", "dp,zero1", "--ranks", "1", *flag])
    groups, skipped = bench.group_modes(args, cores=2, gpus=0)
    assert [mode for mode, _, _ in groups[1]] == modes and skipped == []


def test_ranks_share_the_cores_on_a_gpu_as_on_a_cpu():
    """Each rank takes its share of the node's cores whatever runs the step: offload's CPU Adam runs on torch's
    threads, which a run of train.py on a GPU leaves at torch's default."""
    from app.tools import bench
    args = bench.parse(["--modes", "raw,app", "--configs", "zero3_offload", "--ranks", "2"])
    for gpus in (0, 2):
        groups, _ = bench.group_modes(args, cores=16, gpus=gpus)
        assert [(mode, threads) for mode, threads, _ in groups[1]] == [("raw", 16), ("zero3_offload", 16)]
        assert [(mode, threads) for mode, threads, _ in groups[2]] == [("zero3_offload", 8)]


def test_profile_names_a_list_of_modes():
    from app.tools import bench
    assert bench.parse(["--modes", "raw", "--profile", "raw,zero3+lora,"]).profile == ["raw", "zero3+lora"]
    assert bench.parse(["--modes", "raw"]).profile == []


def test_a_mode_that_raises_on_one_rank_is_a_row_that_says_why_and_on_two_it_ends_the_group(capsys):
    """zero9 is no config of this run: its engine cannot be built (KeyError), as a real config might fail."""
    import torch
    from app.distributed.dist import World
    from app.tools import bench, bench_modes
    args = bench.parse(["--quick", "--batch", "8", "--modes", "raw"])
    work = bench_modes.build_workload(args)
    threads = torch.get_num_threads()
    try:
        row = bench._measured("zero9", args, World(0, 0, 1, 1, torch.device("cpu"), "gloo", "python", ""), 1, 8,
                              work)
        assert row == {"mode": "zero9", "ranks": 1, "failed": "KeyError: 'zero9'"}
        assert capsys.readouterr().out.splitlines()[-1] == "measured zero9 x1: failed, KeyError: 'zero9'"
        with pytest.raises(KeyError):
            bench._measured("zero9", args, World(0, 0, 2, 2, torch.device("cpu"), "gloo", "python", ""), 1, 4, work)
    finally:
        torch.set_num_threads(threads)


def test_compile_choices_name_the_app_modes():
    """--compile off,on runs each config twice, eager and compiled, under names that say which."""
    from app.tools import bench
    args = bench.parse(["--modes", "app", "--configs", "zero1", "--compile", "off,on", "--ranks", "1"])
    groups, _ = bench.group_modes(args, cores=2, gpus=0)
    assert [mode for mode, _, _ in groups[1]] == ["zero1+eager", "zero1+compile"]


def test_ratios_and_the_headline():
    """Each mode against raw PyTorch and against torch at its own world size; scaling against one thread."""
    from app.tools.bench_report import add_ratios, headline
    rows = [{"mode": mode, "ranks": ranks, "step_time_s": step, "samples_per_s": rate, "dtype": "float32",
             "threads_per_rank": 1} for mode, ranks, step, rate in [("raw", 1, 0.010, 3200.0), ("raw-compile", 1, 0.008, 4000.0),
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
             "tensor_parallel": 1, "param_bytes": held, "peak_memory_bytes": peak, "dtype": "float32",
             "threads_per_rank": 1}
            for mode, ranks, step, rate, stages, held, peak in [
                ("raw", 1, 0.010, 100.0, 1, [400], [1000]), ("dp", 1, 0.010, 100.0, 1, [400], [1000]),
                ("pipeline", 2, 0.0107, 93.0, 2, [180, 220], [500, 600])]]
    add_ratios(rows)
    assert rows[2]["speed_vs_one_device"] == pytest.approx(0.93)
    assert splitting(rows) == ["pipeline x2: 0.930x the speed of dp on one rank; per rank 55% of its parameter "
                               "bytes, 60% of its peak memory"]
