"""Sequence parallelism's checks and slices (app/parallel/sequence_parallel.py) in one process; the runs on 2 gloo
ranks are tests/e2e/test_sequence_parallel.py."""
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from app.core.models import HFLogits
from app.core.tasks import next_token_correct, next_token_loss
from app.data.chat import IGNORE
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


def test_the_slices_cover_the_sequence_each_token_predicting_the_next_across_the_cut():
    ids = torch.arange(1, 8).repeat(2, 1)  # 7 tokens: padded to 8 for 2 ranks
    labels = ids.clone()
    labels[1, :3] = IGNORE  # a prompt
    parts = [sequence_parallel.sliced([ids, None], labels, 2, rank) for rank in (0, 1)]
    assert parts[0][0].tolist()[0] == [1, 2, 3, 4] and parts[1][0].tolist()[0] == [5, 6, 7, 0]
    assert parts[0][1].tolist()[0] == [0, 1, 2, 3] and parts[1][1].tolist()[0] == [4, 5, 6, 7]
    assert parts[0][2].tolist()[0] == [2, 3, 4, 5], "the slice's last token predicts the next slice's first"
    assert parts[1][2].tolist()[0] == [6, 7, IGNORE, IGNORE], "the last token and the padding predict nothing"
    assert parts[0][2].tolist()[1] == [IGNORE, IGNORE, 4, 5]
    assert sequence_parallel.counted(labels).tolist() == [6, 4]


def test_the_slices_losses_and_right_answers_add_up_to_the_whole_sequences():
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 7, 11), torch.randint(0, 11, (2, 7))
    labels[0, :2] = IGNORE
    whole_logits = torch.nn.functional.pad(logits, (0, 0, 0, 1))  # the padded position's logits are never counted
    shares, right = torch.zeros(2), torch.zeros(2)
    for rank in (0, 1):
        _, _, targets = sequence_parallel.sliced([labels, None], labels, 2, rank)
        part = whole_logits[:, rank * 4:(rank + 1) * 4]
        losses = torch.nn.functional.cross_entropy(part.flatten(0, 1), targets.flatten(), reduction="none",
                                                   ignore_index=IGNORE)
        shares += losses.view(2, -1).sum(1) / sequence_parallel.counted(labels)
        right += ((part.argmax(-1) == targets) & (targets != IGNORE)).sum(1) / sequence_parallel.counted(labels)
    assert torch.allclose(shares, next_token_loss(logits, labels), atol=1e-6)
    assert torch.allclose(right, next_token_correct(logits, labels), atol=1e-6)
