"""A deep model's activations counted from the same model one and two layers deep: where every layer is alike,
counting two layers instead of 16 or 32 is what makes a plan of llama-8b take under a minute on a laptop's CPU
(docs/memory.md).

The compiled step's graph keeps each layer's tensors and, once, the largest of them (activation_count.kept_bytes):
where the layers are alike, each keeps the same bytes, and the count at depth n is the count at depth 1 plus n - 1
times what the second layer adds.

The eager step's peak is the largest of the bytes alive at each point of the step. At a point before the layers
(the embedding's forward) they grow with the depth by no more than at the points after it. At a point of the top
layer's forward or of the loss, every layer below has left what its forward keeps, autocast's cached casts of its
biases among them: they grow by that (forward, alive once the loss is computed) with each layer. Once autocast
lets go of its casts, and through the backward of the top layers, they grow by what each layer keeps for the
backward (kept, alive as it starts). At a point of the backward of the bottom layers or after it, every layer's
backward has also run: they grow by what the forward and backward of a layer leave together (left, alive as the
step ends). So the peak at depth n is at most the peak at depth 2 plus n - 2 times the largest of the three; where
the peak at depth 2 exceeds the one at depth 1 by exactly that, the point that peaks at 2 grows so, and the bound
is the peak. Where it does not, that micro batch's peak is counted on the whole model. A layer whose tensors the
model's output keeps (router logits, hidden states) would add a fourth growth: such configs are counted whole.

tests/unit/test_depth.py holds both counts equal to the whole model's, byte for byte, for the app's model families,
bf16 weights, checkpointing, LoRA, tiling and DeepSpeed's linear.
"""
import copy
import dataclasses
import functools

import torch

from app.ds.internals import torch_private
from app.memory import activation_count
from app.memory.activation_count import Work
from app.parallel import activations


OUTPUTS = ("output_router_logits", "output_hidden_states", "output_attentions")  # kept by the output, not a layer


def layers_of(config) -> int:
    """A transformers config's number of layers where nothing in it sets one layer apart from another (a list of a
    value per layer that differ: layer_types' sliding and full attention, Llama 4's layers without RoPE; overrides
    per layer, transformers' heterogeneous configs), and no layer leaves tensors in the model's output (OUTPUTS:
    a mixture of experts' router logits), else 0."""
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or getattr(config, "is_heterogeneous", False) or \
            any(getattr(config, name, False) for name in OUTPUTS):
        return 0
    return layers if all(len({repr(v) for v in values}) <= 1 for values in _per_layer(config, layers).values()) else 0


def at(spec, layers: int):
    """spec (models.HFSpec) with its config at layers layers (0: as it is), its lists of a value per layer cut to
    as many."""
    if not layers:
        return spec
    config = copy.deepcopy(spec.config)
    for name, values in _per_layer(config, config.num_hidden_layers).items():
        setattr(config, name, values[:layers])
    config.num_hidden_layers = layers
    return dataclasses.replace(spec, config=config)


def _per_layer(config, layers: int) -> dict:
    """{name: list} of the config's lists of one value per layer."""
    return {name: value for name, value in vars(config).items()
            if isinstance(value, (list, tuple)) and len(value) == layers and layers > 1}


FEWEST = 5  # below it, depths 1 and 2 (3 layers in all, each count twice) save little or nothing on the whole


def layered(work: Work) -> bool:
    """Whether work's model is counted from its depths 1 and 2: a stack of at least FEWEST alike layers, of which
    its depth-2 model has two, every block the same modules and the same parameter shapes (a mixture of experts
    whose first layers are dense is not). Built on fake tensors; a config that cannot be built two layers deep (a
    value that must fit within its layers) is counted whole."""
    if work.layers < FEWEST:
        return False
    try:
        with torch_private.fake_tensor_mode():
            whole, two = (activations.blocks(work.build(layers=n)) for n in (0, 2))
            kinds = {_shape(block) for block in whole + two}
    except Exception:  # the whole model's count says what is wrong with it, if anything
        return False
    return len(whole) == work.layers and len(two) == 2 and len(kinds) == 1


def measured(work: Work, dtype, checkpointed: bool, weights16: bool, compiled: bool, recast: bool = False,
             by_depth: bool = False) -> tuple:
    """activation_count.measured's tuple, from depths 1 and 2 where by_depth (layered(work)): a compiled step's
    where both depths' graphs could be traced, an eager step's as the module's docstring says."""
    how = dict(dtype=dtype, checkpointed=checkpointed, weights16=weights16)
    if by_depth and compiled:
        found = from_two_layers(work, recast=recast, **how)
        if found:
            return found
    if by_depth and not compiled:
        return eager_from_two_layers(work, **how)
    return activation_count.measured(work, compiled=compiled, recast=recast, **how)


def from_two_layers(work: Work, dtype, checkpointed: bool, weights16: bool, recast: bool):
    """The compiled step's measured tuple for work.layers layers from the model at depths 1 and 2, or None where
    one of them could not be traced (the whole model is then counted)."""
    one, two = (activation_count.measured(w, dtype, checkpointed, weights16, True, recast) for w in _shallow(work))
    if one[-1] != "compiled" or two[-1] != "compiled":  # counted eager: the whole model's count decides
        return None
    return (*(b + (work.layers - 2) * (b - a) for a, b in zip(one[:3], two[:3])), *two[3:])


def eager_from_two_layers(work: Work, dtype, checkpointed: bool, weights16: bool) -> tuple:
    """The eager step's measured tuple for work.layers layers: each micro batch's peak from depths 1 and 2 where
    they give it (the module's docstring), else from the whole model."""
    how, peaks = dict(dtype=dtype, checkpointed=checkpointed, weights16=weights16), []
    for micro in (1, 2, 4):
        one, two = (activation_count.step_bytes(w.build, w.inputs, w.loss, micro, **how) for w in _shallow(work))
        layer = max(two.forward - one.forward, two.kept - one.kept, two.left - one.left, 0)
        peaks.append(two.peak + (work.layers - 2) * layer if two.peak - one.peak == layer else
                     activation_count.activation_bytes(work.build, work.inputs, work.loss, micro, **how))
    return (*activation_count.slope(*peaks), "eager")


def _shallow(work: Work) -> tuple:
    """work's model at depths 1 and 2."""
    return tuple(work._replace(build=functools.partial(work.build, layers=n), layers=n) for n in (1, 2))


def _shape(block: torch.nn.Module) -> tuple:
    """A block's modules' names and classes and its parameters' names, shapes and whether they train."""
    return (tuple((name, type(m).__name__) for name, m in block.named_modules()),
            tuple((name, tuple(p.shape), p.requires_grad) for name, p in block.named_parameters()))
