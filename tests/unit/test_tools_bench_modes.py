"""The benchmark's measuring parts in one process: workload, models, rank layouts, eager fallbacks, one raw mode (the
clock, timed loader and parameter bytes: test_tools_bench_common.py)."""
import logging

import pytest
import torch

from app.distributed.dist import World
from app.ds import config as ds_config
from app.ds.internals import torch_private
from app.tools import bench, bench_modes
from app.tools.bench import FIELDS
from app.tools.bench_plan import add_planned_peaks
from app.tools.bench_report import add_ratios

CPU = torch.device("cpu")


def _world(rank=0, world_size=1) -> World:
    return World(rank, rank, world_size, world_size, CPU, "gloo", "python", "")


def _args(*flags):
    return bench.parse(["--quick", "--batch", "8", *flags])


def test_the_workload_and_every_model_built_from_it_are_the_same_for_every_mode():
    work = bench_modes.build_workload(_args("--modes", "raw"))
    assert work.info.num_classes == 10 and len(work.train_set) >= 8 * (3 + 1 + 1)
    first, second = bench_modes.build_model(work), bench_modes.build_model(work)
    torch.manual_seed(123)
    third = bench_modes.build_model(work)
    for a, b, c in zip(first.parameters(), second.parameters(), third.parameters()):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_a_lora_mode_builds_adapters_and_the_next_mode_the_whole_model_again():
    args = bench.parse(["--quick", "--model", "gpt2-tiny", "--seq_len", "8", "--modes", "raw"])
    work = bench_modes.build_workload(args)
    assert work.info.seq_len == 8 and len(work.train_set) == 16 * (3 + 1 + 1)
    adapted = bench_modes.build_model(work, lora=True)
    trained = [name for name, p in adapted.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in name for name in trained)
    whole = bench_modes.build_model(work)
    assert all(p.requires_grad for p in whole.parameters()), "the LoRA choice must not stick to the task"


def test_each_mode_lays_out_its_ranks_as_its_config_says():
    configs = {name: ds_config.load_ds_config(ds_config.REPO / "ds_configs" / f"{name}.json")
               for name in ("dp", "pipeline", "tensor_parallel")}
    args = _args("--modes", "raw")
    args.configs = configs
    of = {mode: bench_modes.rank_layout_of(mode, args, _world(1, 2))
          for mode in ("ddp", "dp", "dp+eager", "pipeline+compile", "pipeline+lora", "tensor_parallel")}
    assert {mode: (ranks.replica, ranks.replicas) for mode, ranks in of.items()} == {
        "ddp": (1, 2), "dp": (1, 2), "dp+eager": (1, 2), "pipeline+compile": (0, 1), "pipeline+lora": (0, 1),
        "tensor_parallel": (0, 1)}
    assert of["pipeline+lora"].split.stages == 2 and of["dp"].split is None
    assert of["tensor_parallel"].tensor == 2 and of["ddp"].tensor == 1


def test_a_frame_of_the_model_that_fell_back_to_eager_is_collected_and_deepspeeds_are_not():
    # the H200's llama-1b under ZeRO-3 (torch 2.11): blocks past the limit by a guard inside DeepSpeed's linear
    log = logging.getLogger(torch_private.DYNAMO_LOGGER)
    with bench_modes.EagerFallbacks() as fallbacks:
        log.warning("torch._dynamo hit config.recompile_limit (8)\n   function: 'forward' (app/core/models.py:40)\n"
                    "   last reason: 0/7: tensor 'x' size mismatch")
        log.warning("torch._dynamo hit config.recompile_limit (8)\n   function: 'hook' (deepspeed/runtime/zero.py:9)")
        log.warning("torch._dynamo hit config.recompile_limit (8)\n   function: 'forward' (modeling_llama.py:295)\n"
                    "   last reason: 14/7: ....ds_id == 69  # deepspeed/runtime/zero/utils.py:153 in is_zero_param")
        log.warning("recompile_limit reached")
        log.warning("a graph break in forward")
        log.info("recompile_limit at info level")
    log.warning("torch._dynamo hit config.recompile_limit (8)\n   function: 'later' (app/x.py:1)")
    assert fallbacks.model_frames == ["function: 'forward' (app/core/models.py:40)",
                                      "function: 'forward' (modeling_llama.py:295)", "recompile_limit reached"]
    assert fallbacks not in log.handlers


def test_a_raw_mode_measured_in_this_process_gives_every_field_the_report_needs(tmp_path, capsys):
    args = _args("--modes", "raw", "--profile", "raw", "--output_dir", str(tmp_path))
    work = bench_modes.build_workload(args)
    model = bench_modes.build_model(work)
    args.flops_per_sample, args.lora_flops_per_sample = work.task.flops_per_sample(model, work.info), 0
    threads = torch.get_num_threads()
    try:
        row = bench_modes.measure("raw", args, _world(), 1, 8, work)
    finally:
        torch.set_num_threads(threads)
    add_ratios([row])
    assert add_planned_peaks([row], args.configs, work) == [], "the plan covers the app modes alone"
    assert set(FIELDS) <= set(row), set(FIELDS) - set(row)
    assert (row["plan_peak_bytes"], row["plan_over_peak"], row["plan_host_bytes"]) == (None, None, None)
    assert len(row["host_peak_bytes"]) == 1 and row["host_peak_bytes"][0] > 0, "the process's resident set"
    assert row["graphs"] == [0, 0], "raw runs eager"
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("profile raw: ") and summary.endswith("; 0 graphs compiled, 0 graph breaks")
    assert (tmp_path / "profile-raw.txt").read_text().splitlines()[0] == summary, "3 steps after the measured ones"
    assert (row["micro_batch"], row["global_batch"], row["ranks"], row["threads_per_rank"]) == (8, 8, 1, 1)
    assert row["param_bytes"] == [sum(p.numel() * 4 for p in model.parameters())]
    assert row["samples_per_s"] == pytest.approx(8 / row["step_time_s"])
    assert row["mfu"] == pytest.approx(row["samples_per_s"] * args.flops_per_sample / row["peak_flops"])
    assert (row["dtype"], row["compiled"], row["zero_state"], row["tokens_per_s"]) == ("float32", False, None, None)
    assert (row["pipeline_stages"], row["tensor_parallel"], row["activation_checkpointing"]) == (1, 1, False)
    assert row["ratio_to_raw"] == 1.0 and len(row["peak_memory_bytes"]) == 1
