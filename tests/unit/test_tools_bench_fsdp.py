"""The benchmark's FSDP2 mode in this process: the blocks it shards one by one, and a model sharded on a one-rank gloo
group. Two ranks, and its losses against the raw loop's: tests/e2e/test_tools_bench.py."""
import pytest
import torch
import torch.distributed as torch_dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from app.distributed.dist import World
from app.tools import bench, bench_fsdp, bench_modes

CPU = torch.device("cpu")


@pytest.fixture
def one_rank(tmp_path):
    """A gloo process group of this process alone, left at the end of the test."""
    torch_dist.init_process_group("gloo", store=torch_dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                                  world_size=1)
    yield World(0, 0, 1, 1, CPU, "gloo", "python", "")
    torch_dist.destroy_process_group()


def _model(name: str):
    return bench_modes.build_model(bench_modes.build_workload(bench.parse(
        ["--quick", "--model", name, "--modes", "raw", "--seq_len", "8", "--batch", "2"])))


@pytest.mark.parametrize("name, block", [("gpt2-tiny", "GPT2Block"), ("llama-tiny", "LlamaDecoderLayer")])
def test_a_transformers_models_blocks_are_the_layers_it_names_as_not_to_be_split(name, block):
    model = _model(name)
    assert block in model.hf._no_split_modules
    found = bench_fsdp.blocks(model)
    assert [type(b).__name__ for b in found] == [block] * 4, "the presets have 4 layers"
    assert len({id(b) for b in found}) == 4


@pytest.mark.parametrize("name", ["cnn", "mlp"])
def test_an_image_model_has_no_blocks_its_root_alone_is_sharded(name):
    assert bench_fsdp.blocks(_model(name)) == []


def test_each_block_and_the_root_hold_their_parameters_as_shards(one_rank):
    model = _model("gpt2-tiny")
    whole = bench_modes.param_bytes(model)
    found = bench_fsdp.shard(model, one_rank, compiled=False)
    assert all(isinstance(m, FSDPModule) for m in [*found, model])
    assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in model.parameters()), "fp32 weights"
    assert bench_modes.param_bytes(model) == whole, "one rank's shards are the whole model, counted once"


def test_an_fsdp2_mode_measured_in_this_process_gives_the_rows_fields(one_rank):
    args = bench.parse(["--quick", "--model", "cnn", "--batch", "8", "--modes", "raw,fsdp2"])
    work = bench_modes.build_workload(args)
    model = bench_modes.build_model(work)
    args.flops_per_sample, args.lora_flops_per_sample = work.task.flops_per_sample(model, work.info), 0
    threads = torch.get_num_threads()
    try:
        row = bench_modes.measure("fsdp2", args, one_rank, 1, 8, work)
    finally:
        torch.set_num_threads(threads)
    assert (row["mode"], row["ranks"], row["micro_batch"], row["global_batch"]) == ("fsdp2", 1, 8, 8)
    assert (row["compiled"], row["dtype"], row["zero_state"]) == (False, "float32", None), "eager on CPU"
    assert row["param_bytes"] == [bench_modes.param_bytes(model)] and row["samples_per_s"] > 0
