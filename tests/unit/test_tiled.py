"""Tiled MLPs (app/parallel/tiled.py) in one process on the CPU, in fp32, on tiny models
built from configs: the same outputs and gradients as the untouched model and the plain loss, and less memory
held for the backward pass."""
import copy
import weakref

import pytest
import torch
from torch import nn
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from app.core import fused_loss
from app.core.models import HFLogits, named_blocks
from app.errors import UserError
from app.settings import Settings
from app.parallel import activations, tiled

EXACT = 1e-6
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _llama(vocab=100, width=128):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=width, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab))


def _gpt2(vocab=100, **extra):
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=vocab, **{**NO_DROPOUT, **extra}))


def _graph_names(tensor) -> set:
    """The class names of every node of tensor's backward graph."""
    names, todo, seen = set(), [tensor.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo += [nxt for nxt, _ in node.next_functions]
    return names


def _most(a, b) -> float:
    """The largest difference of a from b, in units of b's largest value where that is above 1: fp32 rounds a sum
    done in another order (tile by tile) to within 1e-7 of its size, and one ulp at 18 is already 2e-6."""
    return ((a - b).abs().max() / b.abs().max().clamp(min=1)).item()


def _run(model, embeds, mix):
    """(logits, the input's gradient, {name: gradient} of the parameters that get one) of a forward and backward."""
    embeds = embeds.clone().requires_grad_()
    logits = model(inputs_embeds=embeds).logits
    (logits * mix).sum().backward()
    return logits, embeds.grad, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("build", [_llama, _gpt2])
@pytest.mark.parametrize("shards", [1, 2, 3])  # 3 divides neither the sequence (10) nor the rows (20)
def test_tiled_mlps_give_the_same_outputs_and_gradients_as_the_untouched_model(build, shards):
    plain = build()
    model = copy.deepcopy(plain)
    mlps = [block.mlp for block in named_blocks(model)]
    forward = type(mlps[0]).forward
    assert tiled.tile_mlps(HFLogits(model), shards) == (mlps if shards > 1 else [])
    assert all(("forward" in mlp.__dict__) == (shards > 1) for mlp in mlps)
    assert type(mlps[0]).forward is forward, "instances are patched, never a transformers class"
    torch.manual_seed(1)
    embeds, mix = torch.randn(2, 10, 64), torch.randn(2, 10, 100)
    logits, embeds_grad, grads = _run(model, embeds, mix)
    assert ("TiledMLPBackward" in _graph_names(logits)) == (shards > 1)
    want_logits, want_embeds_grad, want_grads = _run(plain, embeds, mix)
    assert _most(logits, want_logits) <= EXACT
    assert _most(embeds_grad, want_embeds_grad) <= EXACT
    assert grads.keys() == want_grads.keys()
    assert max(_most(grads[name], want_grads[name]) for name in grads) <= EXACT


@pytest.mark.parametrize("build", [_llama, _gpt2])
def test_tiled_mlps_inside_checkpointed_blocks_give_the_same_gradients(build):
    plain = build()
    model = copy.deepcopy(plain)
    tiled.tile_mlps(model, 3)
    assert len(activations.checkpoint_blocks(HFLogits(model))) == 2
    embeds, mix = torch.randn(2, 10, 64), torch.randn(2, 10, 100)
    _, embeds_grad, grads = _run(model, embeds, mix)
    _, want_embeds_grad, want_grads = _run(plain, embeds, mix)
    assert _most(embeds_grad, want_embeds_grad) <= EXACT
    assert max(_most(grads[name], want_grads[name]) for name in want_grads) <= EXACT


def test_the_backward_recomputes_each_tile_in_the_autocast_dtype_of_the_forward():
    """DeepSpeed's engine runs only the forward under torch_autocast; a recomputation outside it would be fp32."""
    model = _llama()
    tiled.tile_mlps(model, 2)
    made = []
    model.model.layers[0].mlp.up_proj.register_forward_hook(lambda module, args, out: made.append(out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(inputs_embeds=torch.randn(2, 10, 64, requires_grad=True)).logits
    assert made == [torch.bfloat16] * 2
    logits.float().sum().backward()
    assert made == [torch.bfloat16] * 4


def test_every_gradient_is_left_ready_for_zero_when_the_tiles_asked_do_not_divide_the_rows():
    """DeepSpeed marks gradients ready (ds_grad_is_ready, which ZeRO 1-3 read before reducing one) on its last tile
    index only; 6 tiles asked of 20 rows are 5 pieces of 4, and 7 of 24 are 6 of 4."""
    model = _llama()
    tiled.tile_mlps(model, 6)
    model(inputs_embeds=torch.randn(2, 10, 64, requires_grad=True)).logits.sum().backward()
    mlp_params = [p for layer in model.model.layers for p in layer.mlp.parameters()]
    assert all(p.ds_grad_is_ready for p in mlp_params)


def test_torch_compile_traces_a_tiled_model_to_the_same_gradients():
    """The app's --compile: dynamo breaks its graph around each TiledMLP (a Function that runs a backward inside
    its own), but traces the rest; the eager backend checks the tracing without inductor's build time."""
    plain = _llama()
    model = copy.deepcopy(plain)
    tiled.tile_mlps(model, 3)
    embeds, mix = torch.randn(2, 10, 64), torch.randn(2, 10, 100)
    _, embeds_grad, grads = _run(torch.compile(model, backend="eager"), embeds, mix)
    _, want_embeds_grad, want_grads = _run(plain, embeds, mix)
    assert _most(embeds_grad, want_embeds_grad) <= EXACT
    assert max(_most(grads[f"_orig_mod.{name}"], want_grads[name]) for name in want_grads) <= EXACT


def test_the_tile_counts_follow_their_rules():
    assert [fused_loss.tiles_for(n, 64) for n in (1, 64, 65, 512)] == [1, 1, 2, 8]  # DeepSpeed's ceil(tokens / hidden)
    assert [tiled.pieces(20, k) for k in (1, 3, 6, 7, 40)] == [1, 3, 5, 7, 20]  # what torch.chunk makes
    assert all(len(torch.arange(20).chunk(k)) == tiled.pieces(20, k) for k in range(1, 41))


def test_a_copy_of_a_tiled_model_tiles_its_own_mlps():
    model = _llama()
    tiled.tile_mlps(model, 2)
    twin = copy.deepcopy(model)
    assert all(layer.mlp.forward.__self__ is layer.mlp for layer in twin.model.layers)


@pytest.mark.parametrize("build, fragment", [
    (lambda: _gpt2(resid_pdrop=0.1), "GPT2Block's mlp has dropout \\(p=0.1\\)"),
    (lambda: BertModel(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                  vocab_size=100)), "BertLayer has no `mlp` module to tile"),
    (lambda: nn.Sequential(nn.Linear(4, 4)), "this model names none"),
])
def test_what_tiles_cannot_stand_in_for_is_refused_in_one_line(build, fragment):
    with pytest.raises(UserError, match=fragment):
        tiled.tile_mlps(build(), 2)


def _saved_bytes(run, exclude: set) -> tuple:
    """(run()'s result, bytes of the distinct storages autograd holds for the backward pass when it returns); the
    storages in exclude (the weights) are not counted."""
    held = {}

    class Box:
        def __init__(self, tensor):
            self.tensor = tensor

    def pack(tensor):
        box, storage = Box(tensor), tensor.untyped_storage()
        if storage.data_ptr() not in exclude:
            held[id(box)] = (storage.data_ptr(), storage.nbytes())
            weakref.finalize(box, held.pop, id(box), None)  # a graph run inside the forward lets go of its boxes
        return box

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.tensor):
        result = run()
    return result, sum(dict(held.values()).values())


def _weights(*modules) -> set:
    return {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}


def test_tiled_mlps_hold_less_for_the_backward_pass_at_a_long_sequence():
    plain = _llama(width=256)
    model = copy.deepcopy(plain)
    assert len(tiled.tile_mlps(model)) == 2 and fused_loss.tiles_for(512, 64) == 8  # 0: DeepSpeed's rule per call
    embeds = torch.randn(1, 512, 64, requires_grad=True)
    out, tiled_bytes = _saved_bytes(lambda: model.model(inputs_embeds=embeds).last_hidden_state, _weights(model))
    want, plain_bytes = _saved_bytes(lambda: plain.model(inputs_embeds=embeds).last_hidden_state, _weights(plain))
    assert _most(out, want) <= EXACT
    # measured: 0.39 (2 Llama blocks, width 64, MLP width 256, SDPA attention)
    assert tiled_bytes < 0.6 * plain_bytes, f"tiled MLPs hold {tiled_bytes / plain_bytes:.2f} of the plain bytes"


class _Task:
    """What for_run reads of a task: its settings' --tiled, whether its loss takes a tiled output layer's sums."""
    def __init__(self, choice: str, tiled_loss: bool = True):
        self.settings, self.tiled_loss, self.fused_logits = Settings(tiled=choice), tiled_loss, False


def test_for_run_tiles_on_asked_and_under_sequence_parallelism_alone_on_auto():
    for choice, sequence, tiled_count in (("on", 1, 2), ("auto", 2, 2), ("auto", 1, 0), ("off", 2, 0)):
        model, task = HFLogits(_llama()), _Task(choice)
        tiled.for_run(model, task, sequence, "llama")
        assert sum(hasattr(block.mlp, "tiles") for block in named_blocks(model)) == tiled_count, (choice, sequence)
        assert task.fused_logits == bool(tiled_count)
        assert bool(tiled.describe(model, task.fused_logits)) == bool(tiled_count)
    task = _Task("on", tiled_loss=False)  # a preference pair's loss is not next-token: its MLPs alone
    tiled.for_run(HFLogits(_llama()), task, 1, "llama")
    assert not task.fused_logits


def test_for_run_says_why_auto_keeps_the_mlps_of_a_model_with_dropout_whole_and_on_refuses_it(capsys):
    model, task = HFLogits(_gpt2(resid_pdrop=0.1)), _Task("auto")
    tiled.for_run(model, task, 2, "gpt2")
    assert "tiled: MLPs whole (tiled MLPs: GPT2Block's mlp has dropout (p=0.1)" in capsys.readouterr().out
    assert tiled.describe(model, task.fused_logits) == ("tiled: the output layer with the loss (never the whole "
                                                        "logits) over tiles of the sequence, one per hidden width of "
                                                        "tokens; each tile recomputed in the backward pass")
    with pytest.raises(UserError, match="has dropout"):
        tiled.for_run(model, _Task("on"), 1, "gpt2")
    with pytest.raises(UserError, match="--tiled on: cnn is not a transformers model"):
        tiled.for_run(nn.Linear(2, 2), _Task("on"), 1, "cnn")


def test_a_model_that_scales_or_caps_its_logits_keeps_them_whole():
    """Gemma 2's final soft cap (and Cohere's, Granite's logit scales) come after the output layer, where the tiled
    loss would skip them: its MLPs are tiled, its logits whole."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    config = Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=100, final_logit_softcapping=30.0)
    model, task = HFLogits(Gemma2ForCausalLM(config)), _Task("on")
    tiled.for_run(model, task, 1, "gemma2")
    assert not task.fused_logits and sum(hasattr(block.mlp, "tiles") for block in named_blocks(model)) == 2
    from types import SimpleNamespace
    from transformers import FalconH1Config  # lm_head(h) * lm_head_multiplier
    assert tiled._own_logits(SimpleNamespace(hf=SimpleNamespace(config=FalconH1Config(lm_head_multiplier=0.5)))) \
        == "lm_head_multiplier"
    assert tiled._own_logits(SimpleNamespace(hf=SimpleNamespace(config=FalconH1Config(lm_head_multiplier=1.0)))) == ""


def test_tiled_on_under_pipeline_stages_or_tensor_parallelism_is_one_line():
    from app.parallel import layout
    for ds in ({"pipeline": {"stages": 2}}, {"tensor_parallel": {"autotp_size": 2}}):
        with pytest.raises(UserError, match="--tiled on runs under data parallel, ZeRO 0-3 and sequence "
                                            "parallelism, not pipeline stages or tensor parallelism"):
            tiled.check_layout("on", layout.rank_layout(ds, 2, 0, "p.json"))
        tiled.check_layout("auto", layout.rank_layout(ds, 2, 0, "p.json"))  # auto tiles under SP alone
    tiled.check_layout("on", layout.rank_layout({"sequence_parallel_size": 2}, 2, 0, "sp.json"))
