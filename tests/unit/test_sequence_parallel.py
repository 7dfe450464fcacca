"""Sequence parallelism's checks (app/parallel/sequence_parallel.py) in one process; the slices and their losses are
tests/unit/test_sequence_step.py's, the runs on 2 gloo ranks tests/e2e/test_sequence_parallel.py's."""
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from app.core.models import HFLogits
from app.errors import UserError
from app.parallel import sequence_parallel
from app.parallel.layout import rank_layout


@pytest.mark.parametrize("ds, world, said", [
    ({"sequence_parallel_size": 3}, 2, "sequence_parallel_size 3 does not divide the world size 2"),
    ({"sequence_parallel_size": 0}, 2, "must be a positive integer, got 0"),
    ({"sequence_parallel_size": True}, 2, "must be a positive integer, got True"),
    ({"sequence_parallel_size": 2, "tensor_parallel": {"autotp_size": 2}}, 4, "drop one"),
    ({"sequence_parallel_size": 2, "zero_optimization": {"stage": 3, "reduce_scatter": False}}, 2,
     "under ZeRO-3 takes DeepSpeed's reduce-scatter of gradients"),
])
def test_a_degree_the_world_cannot_take_is_one_line(ds, world, said):
    with pytest.raises(UserError, match=said):
        sequence_parallel.size(ds, world, "sp.json")


def test_the_layout_makes_each_group_of_consecutive_ranks_one_replica():
    layouts = [rank_layout({"sequence_parallel_size": 2}, 4, rank, "sp.json") for rank in range(4)]
    assert [(r.replica, r.replicas, r.sequence) for r in layouts] == [(0, 2, 2), (0, 2, 2), (1, 2, 2), (1, 2, 2)]
    assert rank_layout({}, 4, 3, "dp.json").sequence == 1


def _llama(heads=4, kv=2, attention="sdpa"):
    config = LlamaConfig(hidden_size=16 * heads, intermediate_size=128, num_hidden_layers=1, num_attention_heads=heads,
                         num_key_value_heads=kv, vocab_size=50)
    return HFLogits(LlamaForCausalLM._from_config(config, attn_implementation=attention))


def _tiny(config_name: str, **settings):
    """A 2-layer model of a transformers family, its attention sdpa."""
    import transformers
    config = getattr(transformers, config_name)(**{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                                   "num_attention_heads": 4, "num_key_value_heads": 2,
                                                   "vocab_size": 50, **settings})
    return HFLogits(transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"))


def _mistral(window):
    from transformers import MistralConfig, MistralForCausalLM
    config = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=50, sliding_window=window)
    return HFLogits(MistralForCausalLM._from_config(config, attn_implementation="sdpa"))


@pytest.mark.parametrize("model, degree, said", [
    (lambda: _llama(attention="eager"), 2, "runs attention 'eager', which the app does not split"),
    (lambda: _llama(heads=4, kv=4), 3, "has 4 attention heads \\(4 key/value heads\\), which do not split over 3"),
    (lambda: torch.nn.Linear(2, 2), 2, "is not a transformers language model"),
    (lambda: _llama(attention="flex_attention"), 2, "runs attention 'flex_attention', which the app does not split"),
    (lambda: _mistral(4096), 2, "sets sliding_window, which attention 'sdpa' keeps only through the mask"),
    (lambda: _tiny("Lfm2Config", layer_types=["conv", "full_attention"]), 2,
     "mixes tokens in Lfm2ShortConv \\(a convolution or state space along the sequence\\)"),
    (lambda: _tiny("FalconConfig", num_kv_heads=4), 2, "FalconAttention computes attention itself"),
    (lambda: _tiny("DeepseekV3Config", kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
                   v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                   first_k_dense_replace=1), 2, "query, key and value heads of different widths"),
    (lambda: _tiny("LlamaConfig", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}), 2,
     "scales its RoPE by the length of the positions it is given \\(dynamic\\)"),
])
def test_what_ulysses_cannot_split_is_refused_in_one_line(model, degree, said):
    with pytest.raises(UserError, match=said):
        sequence_parallel.check_model(model(), degree, "llama")


def test_a_mistral_without_a_window_splits():
    sequence_parallel.check_model(_mistral(None), 2, "mistral")


def test_gpt2_and_grouped_key_value_heads_split():
    """2 key/value heads over 4 ranks are replicated (DeepSpeed's rule: one count divides the other)."""
    model = HFLogits(GPT2LMHeadModel._from_config(GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=50),
                                                  attn_implementation="sdpa"))
    sequence_parallel.check_model(model, 2, "gpt2")
    sequence_parallel.check_model(_llama(heads=8, kv=2), 4, "llama")
    with pytest.raises(UserError, match="has 12 attention heads \\(3 key/value heads\\), which do not split"):
        sequence_parallel.check_model(_llama(heads=12, kv=3), 4, "llama")


def test_packing_auto_is_off_where_sequences_are_split(capsys):
    """Instruction data packs by default; under Ulysses, which drops the mask that keeps packed rows apart, the
    default is off (said), and --packing on stays for the task's own one-line refusal."""
    from app.settings import Settings
    assert sequence_parallel.settings_for(Settings(), 2).packing == "off"
    assert "packing: off: sequence_parallel_size 2 splits each row" in capsys.readouterr().out
    assert sequence_parallel.settings_for(Settings(packing="on"), 2).packing == "on"
    assert sequence_parallel.settings_for(Settings(), 1).packing == "auto"
