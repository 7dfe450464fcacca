"""Activation checkpointing in one process: which blocks each model family recomputes, the same gradients,
names and batch-norm statistics as without it, and its one switch (a section the app cannot honour, Megatron's
options). The same per-step losses on 2 ranks under every ZeRO stage: tests/e2e/test_activations.py."""
import copy

import pytest
import torch

from app.parallel import activations
from app.ds import config as ds_config
from app.core import models
from app.data import DataInfo
from app.errors import UserError
from conftest import REPO, config_variant


def _hf(name):
    from app.core.models import HFLogits, hf_class, hf_spec
    spec = hf_spec(name)
    return HFLogits(hf_class(spec.task).from_config(spec.config))


@pytest.mark.parametrize("name, count, kind", [
    ("cnn", 4, {"Conv2d", "Linear"}),  # no blocks: each layer with weights
    ("mlp", 2, {"Linear"}),
    ("resnet18", 8, {"BasicBlock"}),
    ("mobilenet_v3_small", 11, {"InvertedResidual"}),
    ("gpt2-tiny", 4, {"GPT2Block"}),
    ("llama-tiny", 4, {"LlamaDecoderLayer"}),
    ("bert-tiny", 2, {"BertLayer"}),  # not its embeddings, which BERT also names as not to be split
])
def test_each_model_family_checkpoints_its_blocks(name, count, kind):
    model = _hf(name) if "-" in name else models.build_model(name, DataInfo(10, 3, 32))
    found = activations.blocks(model)
    assert len(found) == count and {type(m).__name__ for m in found} == kind


@pytest.mark.parametrize("name", ["cnn", "resnet18"])
def test_recomputing_gives_the_same_gradients_names_and_batch_norm_statistics(name):
    torch.manual_seed(0)
    plain = models.build_model(name, DataInfo(10, 3, 32))
    checkpointed = copy.deepcopy(plain)
    assert len(activations.checkpoint_blocks(checkpointed)) > 1
    assert list(checkpointed.state_dict()) == list(plain.state_dict()), "the same names: checkpoints load either way"
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    for model in (plain, checkpointed):
        torch.nn.functional.cross_entropy(model(x), y).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), checkpointed.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(plain.buffers(), checkpointed.buffers())), \
        "the recomputation does not update running statistics a second time"


def test_a_section_the_app_cannot_honour_is_one_line(tmp_path):
    with pytest.raises(UserError, match="activation_checkpointing must be an object"):
        ds_config.load_ds_config(config_variant(tmp_path, "dp", activation_checkpointing=[]))
    with pytest.raises(UserError, match="a pipeline checkpoints its layers itself"):
        ds_config.load_ds_config(config_variant(tmp_path, "pipeline", activation_checkpointing={}))


def test_megatron_options_load_and_are_named_as_not_applying(tmp_path, capsys):
    """Megatron-DeepSpeed's files partition checkpoints and keep them contiguous or on the CPU: they train here,
    every block checkpointed by torch, and rank 0 says which options do not apply."""
    section = {"partition_activations": True, "contiguous_memory_optimization": True, "cpu_checkpointing": True,
               "number_checkpoints": 4, "synchronize_checkpoint_boundary": False, "profile": False}
    ds = ds_config.load_ds_config(config_variant(tmp_path, "dp", activation_checkpointing=section))
    activations.apply(models.build_model("cnn", DataInfo(10, 1, 8)), ds)
    said = capsys.readouterr().out
    assert "partition_activations, contiguous_memory_optimization, cpu_checkpointing, number_checkpoints " \
           "belong to DeepSpeed's checkpointing for Megatron's models" in said


def test_the_shipped_config_turns_it_on():
    ds = ds_config.load_ds_config(REPO / "ds_configs" / "activation_checkpointing.json")
    assert ds[activations.SECTION] == {}


@pytest.mark.parametrize("how", ["checkpoint", "non_reentrant_checkpoint"])
def test_a_pipelines_checkpointed_layer_updates_its_batch_norm_once(how):
    """DeepSpeed's pipeline checkpoints ResNet's layers with its own function (reentrant, or not with use_reentrant
    false): forward and backward leave the running statistics of one plain forward, and the gradients are
    those of a run without checkpointing."""
    from deepspeed.runtime.activation_checkpointing import checkpointing
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
    twin = copy.deepcopy(layer)
    activations.norms_kept_when_recomputed(layer)
    x = torch.randn(2, 1, 6, 6, requires_grad=True)
    getattr(checkpointing, how)(layer, x).square().sum().backward()
    twin(x).square().sum().backward()
    for name in activations.RUNNING:
        assert torch.equal(getattr(layer[1], name), getattr(twin[1], name)), name
    assert layer[1].num_batches_tracked == 1
    assert all(torch.allclose(a.grad, b.grad) for a, b in zip(layer.parameters(), twin.parameters()))
