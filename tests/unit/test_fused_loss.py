"""The output layer and the next-token loss by tiles (app/core/fused_loss.py), in one process on the CPU in fp32:
the values and gradients of whole logits, less held for the backward pass."""
import copy

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from app.core import fused_loss, lora
from app.core.models import HFLogits
from app.core.tasks import next_token_correct, next_token_loss
from app.data.chat import IGNORE
from app.settings import Settings
from unit.test_tiled import _saved_bytes, _weights


def _llama(vocab=100):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab))


def _gpt2(vocab=100):  # GPT-2's output layer is tied to its input embedding
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=vocab, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0))


def _batch(length=100, vocab=90):  # ids a padded vocabulary of 90 real tokens has too
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (2, length))
    labels = ids.clone()
    labels[0, :7], labels[1, -9:] = IGNORE, IGNORE  # a prompt; padding
    return ids, labels


def _most(a, b) -> float:
    """The largest difference of a from b, in units of b's largest value where that is above 1."""
    return ((a - b).abs().max() / b.abs().max().clamp(min=1)).item()


def _trained(model: HFLogits, fused: bool, weights=torch.tensor([0.7, 1.3])) -> tuple:
    """(per-sample losses, right shares, {name: gradient}) of one weighted backward, fused or from the logits."""
    ids, labels = _batch()
    model.zero_grad(set_to_none=True)
    out = model(ids, None, fused_loss.next_token_targets(labels)) if fused else model(ids)
    losses = next_token_loss(out, labels)
    (losses * weights).sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return losses.detach(), next_token_correct(out, labels), grads


@pytest.mark.parametrize("build, real_vocab", [(_llama, 0), (_llama, 90), (_gpt2, 0)])
def test_tiles_give_the_losses_accuracy_and_gradients_of_whole_logits(build, real_vocab):
    """100 tokens of width 32: 4 tiles, the last shorter; a padded vocabulary's rows masked; a tied output layer
    gets one gradient, its tiles' and the embedding's summed."""
    whole = HFLogits(build(), real_vocab)
    tiled = copy.deepcopy(whole)
    assert fused_loss.tiles_for(100, 32) == 4
    losses, right, grads = _trained(tiled, fused=True)
    want_losses, want_right, want_grads = _trained(whole, fused=False)
    assert _most(losses, want_losses) <= 1e-6 and torch.equal(right, want_right)
    assert grads.keys() == want_grads.keys()
    assert max(_most(grads[name], want_grads[name]) for name in grads) <= 1e-6


def test_lora_adapters_get_the_gradients_of_whole_logits():
    settings = Settings(model="llama", lora=True, lora_rank=4)
    whole = HFLogits(lora.wrap(_llama(), settings, "causal_lm"))
    tiled = copy.deepcopy(whole)
    losses, _, grads = _trained(tiled, fused=True)
    want_losses, _, want_grads = _trained(whole, fused=False)
    assert grads and all("lora" in name for name in grads)
    assert _most(losses, want_losses) <= 1e-6
    assert max(_most(grads[name], want_grads[name]) for name in grads) <= 1e-6


def test_evaluation_takes_the_tiles_without_a_graph():
    model, (ids, labels) = HFLogits(_llama()), _batch()
    with torch.no_grad():
        sums = model(ids, None, fused_loss.next_token_targets(labels))
        want = next_token_loss(model(ids), labels)
    assert not sums.loss.requires_grad and _most(next_token_loss(sums, labels), want) <= 1e-6


def test_the_tiles_hold_less_for_the_backward_pass_than_the_logits():
    """The logits (tokens x vocabulary) and their fp32 copy are what a long sequence's loss holds; by tiles, only
    the hidden states reach the backward pass (measured: 0.03 of the whole logits' bytes at 2 x 512 tokens of a
    1,000-token vocabulary, width 32)."""
    hidden, targets = torch.randn(2, 512, 32, requires_grad=True), torch.randint(0, 1000, (2, 512))
    head = torch.nn.Linear(32, 1000, bias=False)

    def whole():
        logits = head(hidden)
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
    _, whole_bytes = _saved_bytes(whole, _weights(head))
    _, tiled_bytes = _saved_bytes(lambda: fused_loss.token_sums(hidden, head, targets).loss.sum(), _weights(head))
    assert tiled_bytes < 0.1 * whole_bytes, f"the tiles hold {tiled_bytes / whole_bytes:.3f} of the logits' bytes"


def test_the_targets_are_the_next_labels():
    labels = torch.tensor([[5, 6, IGNORE, 8]])
    assert fused_loss.next_token_targets(labels).tolist() == [[6, IGNORE, 8, IGNORE]]
    assert [fused_loss.tiles_for(n, 32) for n in (1, 32, 33, 100)] == [1, 1, 2, 4]


def test_the_padded_vocabulary_is_masked_out_of_place():
    """The columns from the real vocabulary on are -inf and take no gradient; the logits given stay as they were (in
    place, a compiled ZeRO-3 step held them twice: tests/e2e/test_compiling.py); no padding, the same tensor."""
    logits = torch.randn(2, 3, 8, requires_grad=True)
    masked = fused_loss.masked_padding(logits, 6)
    assert (masked[..., 6:] == float("-inf")).all() and torch.equal(masked[..., :6], logits[..., :6])
    assert torch.isfinite(logits).all(), "the input is not masked"
    masked.log_softmax(-1)[..., :6].sum().backward()
    assert (logits.grad[..., 6:] == 0).all() and (logits.grad[..., :6] != 0).any()
    assert fused_loss.masked_padding(logits, 0) is logits
