"""Tensor parallelism through DeepSpeed AutoTP for real: llama-tiny on 2 gloo shards against one process, and
export of the gathered weights."""
import pytest
import torch

from conftest import config_variant, read_metrics, read_summary, train, train_jobs, write_text_rows

LLAMA = ["--model", "llama-tiny", "--block_size", 32, "--max_steps", 12, "--log_interval", 1, "--seed", 3]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """tag -> output_dir: llama-tiny in one process, and 2 ranks x 2 shards under ZeRO 0 and 1 in one launch."""
    root = tmp_path_factory.mktemp("tensor-parallel")
    corpus = write_text_rows(root / "corpus.txt", 600)
    train("python", 1, "--deepspeed_config", config_variant(root, "dp", train_micro_batch_size_per_gpu=8),
          "--dataset", corpus, *LLAMA, "--output_dir", root / "one")
    (root / "zero1").mkdir()
    configs = {"zero0": config_variant(root, "tensor_parallel", train_micro_batch_size_per_gpu=8),
               "zero1": config_variant(root / "zero1", "tensor_parallel", train_micro_batch_size_per_gpu=8,
                                       zero_optimization={"stage": 1})}
    outputs = train_jobs("ranks", 2, [["--deepspeed_config", config, "--dataset", corpus, *LLAMA,
                                           "--output_dir", root / tag] for tag, config in configs.items()])
    return {"one": root / "one", **{tag: (root / tag, out) for tag, out in zip(configs, outputs)}}


@pytest.mark.parametrize("tag", ["zero0", "zero1"])
def test_two_shards_give_the_losses_of_one_process(tag, runs):
    out, stdout = runs[tag]
    one = [r["loss"] for r in read_metrics(runs["one"])[0]]
    two = [r["loss"] for r in read_metrics(out)[0]]
    assert len(one) == len(two) == 12 and two[-1] < two[0] - 1
    # the row-parallel layers all-reduce partial matmuls, so sums run in another order (1e-6 at step 1): within
    # 1e-5 under ZeRO 0; ZeRO 1's flattened fp32 partition drifts a little further (measured 4e-5 on losses of 9)
    tolerance = 1e-5 if tag == "zero0" else 1e-5 * one[0]
    assert max(abs(a - b) for a, b in zip(one, two)) < tolerance, list(zip(one, two))
    assert "tensor parallel: DeepSpeed AutoTP shards each layer across 2 ranks x 1 data-parallel replica(s)" in stdout
    assert "global batch 8," in stdout
    summary = read_summary(out)
    assert summary["tensor_parallel_size"] == 2 and summary["world_size"] == 2
    assert summary["samples"] == read_summary(runs["one"])["samples"] == 12 * 8, "a replica's samples, once"


def test_export_gathers_the_full_weights(runs, tmp_path):
    """The 2-shard checkpoint exports to a save_pretrained folder of whole tensors, equal to one process's."""
    from transformers import AutoModelForCausalLM
    from app.tools.export import export
    step = "checkpoints/step00000012"
    export(runs["zero0"][0] / step, tmp_path / "two")
    export(runs["one"] / step, tmp_path / "one")
    two = AutoModelForCausalLM.from_pretrained(tmp_path / "two").state_dict()
    one = AutoModelForCausalLM.from_pretrained(tmp_path / "one").state_dict()
    assert two.keys() == one.keys()
    assert two["model.layers.0.mlp.gate_proj.weight"].shape == (512, 256), "whole, not a shard"
    assert max((two[k] - one[k]).abs().max().item() for k in one) < 1e-4
    assert not torch.equal(two["lm_head.weight"], torch.zeros_like(two["lm_head.weight"]))
