"""Pipeline parallelism in one process: the "pipeline" section, the data-parallel rank DeepSpeed's topology gives,
the split of each model family into layers that compute the same, and what cannot be split. Real pipelined runs
(gloo, 2 and 3 CPU ranks) against one process: tests/e2e/test_pipeline.py."""
import json

import pytest
import torch
from torch import nn

from app.core import models
from app.parallel import pipeline
from app.data import DataInfo
from app.data.loader import ShardSampler
from app.errors import UserError
from conftest import REPO

DP = json.loads((REPO / "ds_configs" / "dp.json").read_text())
PIPE = json.loads((REPO / "ds_configs" / "pipeline.json").read_text())


def test_pipeline_json_plans_two_stages():
    assert pipeline.stage_plan(PIPE, 2, "pipeline.json") == pipeline.StagePlan(2, "parameters", 0)
    assert pipeline.stage_plan(DP, 2, "dp.json") is None


@pytest.mark.parametrize("section, zero, world, text", [
    ({"stages": 2, "partiton": "uniform"}, 0, 2, "unknown key pipeline.partiton (did you mean 'partition'?)"),
    ({"stages": "2"}, 0, 2, "pipeline.stages must be int"),
    ({"stages": 0}, 0, 2, "set pipeline.stages"),
    ({"stages": 2, "partition": "best"}, 0, 2, "pipeline.partition must be one of parameters, uniform, type:"),
    ({"stages": 2}, 2, 2, "cannot pipeline with ZeRO stage 2"),
    ({"stages": 2}, 3, 2, "cannot pipeline with ZeRO stage 3"),
    ({"stages": 2}, 0, 3, "pipeline.stages 2 does not divide the world size 3"),
    ({"stages": 2, "activation_checkpoint_interval": -1}, 0, 2, "activation_checkpoint_interval must be 0"),
    ({"stages": 2, "partition": "type:Basic[Block"}, 0, 2, "'type:Basic[Block' is not a regular expression"),
    ({"stages": 2, "partition": "type:(?:Conv2d|Linear)"}, 0, 2, "reads the regex only up to its first ':' ('(?')"),
    ({"stages": 2, "seed_layers": True}, 0, 2, "pipeline.seed_layers reseeds layers DeepSpeed builds"),
])
def test_a_wrong_pipeline_section_is_one_line(section, zero, world, text):
    ds = {**DP, "pipeline": section, "zero_optimization": {"stage": zero}}
    with pytest.raises(UserError) as caught:
        pipeline.stage_plan(ds, world, "x.json")
    assert text in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("world, stages", [(2, 2), (4, 2), (6, 3), (6, 2), (3, 3)])
def test_data_parallel_rank_follows_deepspeeds_topology(world, stages):
    """The loader's shard is the replica DeepSpeed's pipe-major topology gives the rank, not the world rank."""
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
    topology = PipeDataParallelTopology(num_pp=stages, num_dp=world // stages)
    for rank in range(world):
        coord = topology.get_coord(rank)
        assert pipeline.data_parallel(pipeline.StagePlan(stages), world, rank) == (coord.data, world // stages)


def test_two_stages_by_two_replicas_see_every_sample_once_per_epoch():
    """4 ranks = 2 stages x 2 replicas: the two replicas split the epoch, the stages of a replica share theirs."""
    seen = {}
    for rank in range(4):
        replica, replicas = pipeline.data_parallel(pipeline.StagePlan(2), 4, rank)
        sampler = ShardSampler(101, 8, replica, replicas, shuffle=True, seed=3)
        sampler.set_epoch(1)
        seen[rank] = [i for batch in sampler for i, w in batch if w > 0]
    assert seen[0] == seen[2] and seen[1] == seen[3], "stage 0 and stage 1 of a replica load the same samples"
    assert sorted(seen[0] + seen[1]) == list(range(101)), "each sample once per epoch across the replicas"


def chained(layers: list, x):
    """Run a split model's layers one after another, as the stages do between them."""
    built = {}
    for layer in layers:
        if isinstance(layer, nn.Module):
            x = layer(x)
        else:  # a TiedLayerSpec: one module per key, the output projection through its forward_fn
            module = built.setdefault(layer.key, layer.build())
            x = layer.forward_fn(module, x) if layer.forward_fn else module(x)
    return x


@pytest.mark.parametrize("name, info, x", [
    ("cnn", DataInfo(10, 1, 8), torch.randn(4, 1, 8, 8)),
    ("mlp", DataInfo(10, 1, 8), torch.randn(4, 1, 8, 8)),
    ("resnet18", DataInfo(10, 3, 32), torch.randn(4, 3, 32, 32)),
])
def test_image_models_split_into_layers_that_compute_the_same(name, info, x):
    torch.manual_seed(0)
    model = models.build_model(name, info).eval()
    layers = pipeline.layers_of(model, name)
    with torch.no_grad():
        assert torch.equal(chained(layers, x), model(x))
    names = pipeline.layer_names(model, layers)
    assert sorted(n for own in names for many in own.values() for n in many) == sorted(model.state_dict())


def test_gpt2_splits_with_tied_embeddings_and_causal_blocks():
    """Each block stays causal on its own: a later token never changes an earlier position's logits."""
    from app.data.tokenizers import byte_tokenizer
    torch.manual_seed(0)
    model = models.build_hf(models.hf_spec("gpt2-tiny"), DataInfo(0, task="causal_lm"), byte_tokenizer(), {})
    model.eval()
    layers = pipeline.layers_of(model, "gpt2-tiny")
    assert layers[0].key == layers[-1].key == "wte" and layers[-1].forward_fn is pipeline.tied_logits
    ids = torch.randint(200, (2, 16))
    with torch.no_grad():
        split, whole = chained(layers, ids), model(ids)
        changed = ids.clone()
        changed[:, 10:] = (changed[:, 10:] + 1) % 200
        later = chained(layers, changed)
    assert torch.allclose(split, whole, atol=1e-5, rtol=0)
    assert torch.equal(later[:, :10], split[:, :10]) and not torch.equal(later[:, 10:], split[:, 10:])
    assert (split[..., models.vocab_size(model.hf.config):] == float("-inf")).all(), "padded rows never win"
    names = pipeline.layer_names(model, layers)
    assert "hf.lm_head.weight" in names[0]["wte.weight"] and "hf.transformer.wte.weight" in names[0]["wte.weight"]


def test_a_model_that_cannot_be_split_says_why():
    from app.data.tokenizers import byte_tokenizer
    bert = models.build_hf(models.hf_spec("bert-tiny"), DataInfo(2, task="sequence_classification"),
                           byte_tokenizer(), {})
    with pytest.raises(UserError, match="bert-tiny cannot be split into pipeline stages.*ZeRO stage 3"):
        pipeline.layers_of(bert, "bert-tiny")


def test_more_stages_than_layers_is_one_line():
    model = models.build_model("mlp", DataInfo(10, 1, 8))
    with pytest.raises(UserError, match="pipeline.stages 5 is more than the 4 layers mlp splits into"):
        pipeline.split(model, "mlp", pipeline.StagePlan(5), task=None)
