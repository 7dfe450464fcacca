"""A deep model's activations counted from its depths 1 and 2 (app/memory/depth.py): the same bytes as the whole
model's count, compiled and eager; only deep stacks of alike layers are counted so."""
import contextlib
import functools

import pytest
import torch

from app.core import models, resolver
from app.ds import internals as ds_internals
from app.memory import activation_count, depth, planner
from app.settings import Settings

BF16 = torch.bfloat16
CASES = {  # name: (model, settings, how counted)
    "bf16 autocast": ("gpt2-tiny", {}, dict(dtype=BF16, checkpointed=False, weights16=False, recast=False)),
    "ZeRO-3's linear": ("gpt2-tiny", {}, dict(dtype=BF16, checkpointed=False, weights16=False, recast=True)),
    "bf16 weights": ("llama-tiny", {}, dict(dtype=BF16, checkpointed=False, weights16=True, recast=False)),
    "fp32, LoRA, tiled": ("llama-tiny", {"lora": True, "tiled": "on"},
                          dict(dtype=None, checkpointed=False, weights16=False, recast=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_layers_count_what_the_whole_models_compiled_step_keeps(case):
    """Each count of a 4-layer model's compiled step from its depths 1 and 2 is the whole model's, byte for byte."""
    model, flags, how = CASES[case]
    task = resolver.build(Settings(model=model, **flags))
    work = planner.workload(task, 128, frozen=bool(flags.get("lora")))
    assert work.layers == 4
    with ds_internals.deepspeed_linear() if how["recast"] else contextlib.nullcontext():
        whole = activation_count.measured(work, compiled=True, **how)
        assert whole[-1] == "compiled"
        assert depth.from_two_layers(work, **how) == whole


EAGER = {  # name: (model, settings, how counted)
    "bf16 autocast": ("gpt2-tiny", {}, dict(dtype=BF16, checkpointed=False, weights16=False)),
    "checkpointed": ("gpt2-tiny", {}, dict(dtype=BF16, checkpointed=True, weights16=False)),
    "fp32": ("llama-tiny", {}, dict(dtype=None, checkpointed=False, weights16=False)),
    "bf16 weights, LoRA": ("llama-tiny", {"lora": True}, dict(dtype=BF16, checkpointed=False, weights16=True)),
    "tiled": ("llama-tiny", {"tiled": "on"}, dict(dtype=BF16, checkpointed=False, weights16=False)),
}


@pytest.mark.parametrize("case", list(EAGER))
def test_where_the_peak_grows_by_a_layers_largest_share_from_one_layer_to_two_it_does_so_to_four(case):
    """The eager rule, micro batch by micro batch: where the peak at depth 2 exceeds the one at depth 1 by the
    largest of what a layer leaves alive at the loss, as the backward starts and as it ends, the peak at depth 4 is
    the one at 2 plus twice that. It does so at 2 and 4 samples in every case; gpt2-tiny's peak at one sample lies
    before its layers at depth 1 (its tied embedding's two gradients), and that micro batch is counted whole.
    eager_from_two_layers then gives the whole model's count."""
    model, flags, how = EAGER[case]
    task = resolver.build(Settings(model=model, **flags))
    work = planner.workload(task, 128, frozen=bool(flags.get("lora")))
    from_two = []
    for micro in (1, 2, 4):
        one, two, four = (activation_count.step_bytes(functools.partial(work.build, layers=n), work.inputs,
                                                      work.loss, micro, **how) for n in (1, 2, 4))
        layer = max(two.forward - one.forward, two.kept - one.kept, two.left - one.left, 0)
        assert four.peak <= two.peak + 2 * layer, micro
        if two.peak - one.peak == layer:
            from_two.append(micro)
            assert four.peak == two.peak + 2 * layer, micro
    assert from_two == ([2, 4] if model == "gpt2-tiny" else [1, 2, 4])
    assert depth.measured(work, compiled=False, by_depth=True, **how) == activation_count.measured(
        work, compiled=False, **how)


def _folder(folder, config) -> str:
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    config.save_pretrained(folder)
    return str(folder)


def test_only_a_deep_stack_of_alike_layers_is_counted_from_two(tmp_path):
    """llama-1b's 16 alike layers are, and a mixture of experts' 6; gpt2-tiny's 4 are too few to pay; the same
    mixture whose first layer is dense, and a model whose upper layers attend through a sliding window, are counted
    whole."""
    from transformers import Qwen2Config, Qwen2MoeConfig
    shape = dict(num_hidden_layers=6, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512)
    experts = dict(moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2)
    moe = _folder(tmp_path / "moe", Qwen2MoeConfig(**shape, **experts))
    dense_first = _folder(tmp_path / "dense-first", Qwen2MoeConfig(**shape, **experts, mlp_only_layers=[0]))
    sliding = _folder(tmp_path / "sliding", Qwen2Config(**shape, use_sliding_window=True, max_window_layers=3))
    works = {name: planner.workload(resolver.build(Settings(model=name)), 128)
             for name in ("llama-1b", moe, "gpt2-tiny", dense_first, sliding)}
    assert [work.layers for work in works.values()] == [16, 6, 4, 6, 0]
    assert [depth.layered(work) for work in works.values()] == [True, True, False, False, False]


def test_a_config_that_sets_a_layer_apart_has_no_depth_to_count_from():
    """Llama 4 leaves RoPE out of every fourth layer (no_rope_layers, a value per layer): its layers look alike and
    compute apart; so may a layer's own overrides, and an output that keeps every layer's hidden states grows with
    the depth where no layer's count sees it. A list of one value for every layer sets none apart, and is cut with
    the depth."""
    from transformers import Llama4TextConfig, LlamaConfig
    assert depth.layers_of(Llama4TextConfig(num_hidden_layers=6)) == 0
    assert depth.layers_of(LlamaConfig(num_hidden_layers=6, per_layer_config={3: {"intermediate_size": 64}})) == 0
    assert depth.layers_of(LlamaConfig(num_hidden_layers=6, output_hidden_states=True)) == 0
    spec = models.HFSpec(LlamaConfig(num_hidden_layers=6, layer_types=["full_attention"] * 6), "", "causal_lm", 128)
    assert depth.layers_of(spec.config) == 6
    cut = depth.at(spec, 2).config
    assert (cut.num_hidden_layers, cut.layer_types, spec.config.num_hidden_layers) == (2, ["full_attention"] * 2, 6)
