"""The benchmark's report: the one-device reference, the table, the headline, checkpointing, LoRA, the chart."""
import pytest

from app.tools.bench_report import add_ratios, adapters, checkpointing, headline, headline_vs_fsdp2, one_device, \
    plot, table


def _row(mode, ranks=1, step=0.010, rate=100.0, **more) -> dict:
    """A measured row as bench_modes.measure returns it, with the fields the report reads."""
    row = {"mode": mode, "ranks": ranks, "threads_per_rank": 1, "micro_batch": 32, "dtype": "float32",
           "step_time_s": step, "samples_per_s": rate, "tokens_per_s": None, "mfu": 0.25, "mfu_datasheet": None,
           "data_wait_share": 0.05, "time_to_first_step_s": 1.5, "peak_memory_bytes": [100 * 2**20] * ranks,
           "param_bytes": [4 * 2**20] * ranks, "zero_state": None, "compiled": False, "pipeline_stages": 1,
           "tensor_parallel": 1}
    return {**row, **more}


def test_a_split_model_is_measured_against_the_first_unsplit_app_mode_on_one_rank():
    rows = [_row("raw"), _row("dp", ranks=2), _row("pipeline", pipeline_stages=2), _row("zero1"), _row("zero2")]
    assert one_device(rows)["mode"] == "zero1", "not raw, not a 2-rank mode, not a split one"


def test_without_an_unsplit_app_mode_on_one_rank_the_raw_loop_is_the_reference():
    assert one_device([_row("tensor_parallel", tensor_parallel=2), _row("raw"), _row("raw", ranks=2)])["mode"] == "raw"
    assert one_device([_row("ddp", ranks=2), _row("dp", ranks=2)]) is None
    rows = [_row("ddp", ranks=2), _row("dp", ranks=2)]
    add_ratios(rows)
    assert [r["speed_vs_one_device"] for r in rows] == [None, None]


def test_the_headline_says_what_it_needs_when_raw_compile_or_a_one_rank_app_mode_is_missing():
    needs = "headline: needs the raw-compile mode and an app mode at 1 rank"
    rows = [_row("raw"), _row("dp")]
    add_ratios(rows)
    assert headline(rows) == needs
    rows = [_row("raw-compile", step=0.008), _row("dp", ranks=2), _row("dp+lora", step=0.004)]
    add_ratios(rows)
    assert headline(rows) == needs, "a LoRA mode trains less than the whole model: it is no headline"


def test_the_second_headline_compares_each_app_mode_with_fsdp2_at_its_own_world_size():
    rows = [_row("raw", step=0.010), _row("raw-compile", step=0.008), _row("fsdp2", step=0.012),
            _row("fsdp2", ranks=2, step=0.020), _row("zero3", step=0.016), _row("zero3+lora", step=0.006),
            _row("dp", step=0.006), _row("zero3", ranks=2, step=0.025), _row("ddp", ranks=2, step=0.010),
            _row("zero1", ranks=4, step=0.010)]
    add_ratios(rows)
    assert headline(rows) == "headline (app speed / raw PyTorch + compile + fused AdamW, 1 rank): zero3 0.500, dp " \
                             "1.333", "the first headline as it was"
    assert headline_vs_fsdp2(rows) == ["headline vs FSDP2 (app speed / torch FSDP2 at the same world size): zero3 x1 "
                                       "0.750, dp x1 2.000, zero3 x2 0.800"], "no LoRA, no world size without fsdp2"
    by = {(r["mode"], r["ranks"]): r["speed_vs_fsdp2"] for r in rows}
    assert by[("fsdp2", 1)] == by[("fsdp2", 2)] == 1.0 and by[("raw", 1)] == pytest.approx(1.2)
    assert by[("ddp", 2)] == pytest.approx(2.0) and by[("zero1", 4)] is None


def test_a_mode_is_compared_with_no_mode_that_ran_in_another_dtype():
    """--dtype bf16 on a CPU: the torch modes in bf16, the app's in its ds_config's fp32; no ratio between them."""
    rows = [_row("raw", dtype="bfloat16"), _row("raw-compile", dtype="bfloat16"), _row("fsdp2", dtype="bfloat16"),
            _row("ddp", ranks=2, dtype="bfloat16"), _row("dp"), _row("dp", ranks=2)]
    add_ratios(rows)
    app = [r for r in rows if r["mode"] == "dp"]
    assert all(r[key] is None for r in app for key in ("ratio_to_raw", "ratio_to_torch", "speed_vs_raw_compile",
                                                         "speed_vs_fsdp2"))
    assert rows[0]["ratio_to_raw"] == 1.0 and rows[3]["ratio_to_torch"] == 1.0, "each against its own kind"
    assert headline(rows).startswith("headline: needs")
    rows = [_row("raw-1thread", rate=100.0), _row("ddp", ranks=2, rate=150.0), _row("dp", ranks=2, rate=400.0,
                                                                                     threads_per_rank=4)]
    add_ratios(rows)  # 8 cores, 2 ranks: 4 threads each against one
    assert rows[1]["scaling_efficiency"] == 0.75 and rows[2]["scaling_efficiency"] is None


def test_without_an_fsdp2_row_or_an_app_mode_beside_it_there_is_no_second_headline():
    rows = [_row("raw"), _row("dp"), _row("fsdp2", ranks=2), _row("ddp", ranks=2)]
    add_ratios(rows)
    assert headline_vs_fsdp2(rows) == [] and headline_vs_fsdp2([_row("raw"), _row("zero3")]) == []


def test_the_table_has_a_header_and_one_aligned_line_per_mode():
    rows = [_row("raw", step=0.0125, rate=2560.0), _row("dp", step=0.02, rate=1600.0, mfu_datasheet=0.4,
                                                       zero_state={"measured_over_formula": 1.0625})]
    add_ratios(rows)
    lines = table(rows).splitlines()
    assert len(lines) == 3 and len({len(line) for line in lines}) == 1, lines
    header, raw, dp = (line.split() for line in lines)
    assert header[:7] == ["mode", "ranks", "thr", "batch", "dtype", "step", "ms"] and "samples/s" in header
    assert raw == ["raw", "1", "1", "32", "float32", "12.5", "2560", "1.000", "1.000", "-", "0.25", "-", "5.0%",
                   "1.50", "100", "-", "-"]
    assert dp[5:8] == ["20.0", "1600", "1.600"] and dp[11] == "0.40" and dp[-1] == "1.062"
    rows.append(_row("trl-deepspeed_zero2+compile", step=0.02, rate=1600.0))  # a file's stem names the mode
    add_ratios(rows)
    lines = table(rows).splitlines()
    assert len({len(line) for line in lines}) == 1 and lines[-1].split()[:2] == ["trl-deepspeed_zero2+compile", "1"]


def test_the_table_counts_tokens_for_language_models_and_the_largest_ranks_peak_memory():
    rows = [_row("dp", ranks=2, rate=4.0, tokens_per_s=512.0, peak_memory_bytes=[300 * 2**20, 700 * 2**20])]
    add_ratios(rows)
    header, line = (line.split() for line in table(rows).splitlines())
    assert "tokens/s" in header and "samples/s" not in header
    assert line[6] == "512" and line[14] == "700"


def test_activation_checkpointing_is_compared_with_dp_at_the_same_ranks_and_compile_setting():
    rows = [_row("dp", step=0.010, peak_memory_bytes=[800 * 2**20]),
            _row("dp+lora", step=0.005, peak_memory_bytes=[100 * 2**20]),
            _row("dp", step=0.050, compiled=True, peak_memory_bytes=[900 * 2**20]),
            _row("activation_checkpointing", step=0.0125, activation_checkpointing=True,
                 peak_memory_bytes=[200 * 2**20]),
            _row("activation_checkpointing", ranks=2, activation_checkpointing=True)]
    assert checkpointing(rows) == ["activation_checkpointing x1: activation checkpointing runs at 0.800x the speed "
                                   "of dp and peaks at 25% of its memory (600 MB saved)"]


def test_lora_is_compared_with_training_the_whole_model_in_the_same_mode():
    rows = [_row("zero1", tokens_per_s=1000.0, peak_memory_bytes=[2048 * 2**20]),
            _row("zero1+lora", tokens_per_s=1500.0, peak_memory_bytes=[1024 * 2**20]),
            _row("zero2+lora", tokens_per_s=900.0), _row("dp", rate=10.0), _row("dp+lora", rate=15.0)]
    assert adapters(rows) == [
        "zero1+lora x1: LoRA trains at 1.500x the tokens/s of the whole model (1,500 vs 1,000) and peaks at 50% of "
        "its memory (1,024 vs 2,048 MB)",
        "dp+lora x1: LoRA trains at 1.500x the samples/s of the whole model (15 vs 10) and peaks at 100% of its "
        "memory (100 vs 100 MB)"]


def test_lora_alone_is_compared_with_nothing_and_makes_no_headline():
    """--lora only: a model too large to train whole has its LoRA rows and no whole-model row beside them."""
    rows = [_row("raw"), _row("raw-compile", step=0.008), _row("fsdp2"), _row("zero1+lora", step=0.004),
            _row("zero3+lora", ranks=2, step=0.006)]
    add_ratios(rows)
    assert adapters(rows) == [] and headline_vs_fsdp2(rows) == []
    assert headline(rows) == "headline: needs the raw-compile mode and an app mode at 1 rank"
    assert rows[3]["speed_vs_raw_compile"] == pytest.approx(2.0), "the ratios still say how LoRA compares"


@pytest.mark.parametrize("count", [1, 12])
def test_the_chart_is_written_as_a_png(tmp_path, count):
    rows = [_row(f"mode{i}", pipeline_stages=2 if i % 2 else 1) for i in range(count)]
    plot(rows, tmp_path / "bench.png")
    data = (tmp_path / "bench.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
