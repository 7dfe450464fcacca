"""Activation checkpointing: each of a model's blocks keeps only its input during the forward pass and computes its
activations again in the backward pass, for every model the app builds and under every ZeRO stage.

It is torch's non-reentrant checkpoint, around each block's whole call (hooks included, so ZeRO-3 gathers the
block's parameters again for the recomputation). Non-reentrant rather than reentrant: it needs no input that
requires a gradient (a block fed token ids or a frozen stem still works), the backward of a non-scalar loss
works, torch.compile traces it (a block with batch norms, whose running statistics the recomputation must
leave alone, breaks the graph around itself), and it is the flavour PyTorch recommends. Its known ZeRO-3 failure comes with
frozen parameters, which the app never has.

DeepSpeed's own "activation_checkpointing" section in the JSON turns it on (it owns the memory a rank needs,
beside ZeRO and offload). Its options belong to DeepSpeed's reentrant implementation for Megatron's models
(partitioning checkpoints across model-parallel ranks, keeping them contiguous or on the CPU): a file that sets
them still trains, with every block checkpointed, and rank 0 says in one line which options do not apply.
"""
import contextlib
import functools
from collections import Counter

import torch
from torch import nn

from app.core import models
from app.ds.config import ACTIVATION_CHECKPOINTING as SECTION
from app.ds.internals import torch_private

# DeepSpeed's options for its own checkpointing function, at the values this implementation matches.
DEFAULTS = {"partition_activations": False, "contiguous_memory_optimization": False, "cpu_checkpointing": False,
            "number_checkpoints": None, "synchronize_checkpoint_boundary": False, "profile": False}



def apply(model: nn.Module, ds: dict) -> nn.Module:
    """model with its blocks checkpointed when the DeepSpeed dict has the section (said once by rank 0)."""
    if SECTION in ds:
        found = checkpoint_blocks(model)
        from app.distributed import dist
        dist.print0(f"activation checkpointing: {len(found)} {type(found[0]).__name__ if found else 'block'}(s) "
                    f"keep only their inputs and recompute their activations in the backward pass")
        unused = [key for key, value in ds[SECTION].items() if key in DEFAULTS and value != DEFAULTS[key]]
        if unused:
            dist.print0(f"activation checkpointing: {', '.join(unused)} belong to DeepSpeed's checkpointing for "
                        f"Megatron's models; torch's checkpoint of each block, kept on the device, is used instead")
    return model


def blocks(model: nn.Module) -> list:
    """The modules whose activations are recomputed: a transformers model's layers (the most frequent of the
    classes it names as not to be split), else the instances of the most frequent class of composite module (ResNet's blocks,
    ViT's encoder blocks; the outermost when nested classes are as frequent), else each layer with weights."""
    layers = models.named_blocks(model)
    if layers:
        return layers
    composite = [m for m in model.modules() if m is not model and list(m.children()) and
                 not isinstance(m, (nn.Sequential, nn.ModuleList, nn.ModuleDict))]
    counts = Counter(type(m) for m in composite)
    if counts and counts.most_common(1)[0][1] > 1:
        top = counts.most_common(1)[0][1]
        tied = {cls for cls, count in counts.items() if count == top}
        inner = {type(sub) for m in composite if type(m) in tied for sub in m.modules() if sub is not m}
        cls = next(c for c in counts if c in tied and c not in inner)
        return [m for m in composite if type(m) is cls]
    return [m for m in model.modules() if not list(m.children()) and any(True for _ in m.parameters(recurse=False))]


def checkpoint_blocks(model: nn.Module) -> list:
    """Make every block of model checkpoint itself; the blocks. Names and state dict keys stay as they were:
    each block's class becomes a subclass that runs its call under torch's checkpoint."""
    found = blocks(model)
    for block in found:
        block.__class__ = _checkpointed(type(block))
    return found


@functools.lru_cache(maxsize=None)
def _checkpointed(cls):
    return type(cls.__name__, (cls,), {"__call__": _call, "__module__": cls.__module__})


def _call(self, *args, **kwargs):
    if not (self.training and torch.is_grad_enabled()):  # evaluation keeps nothing for a backward anyway
        return nn.Module.__call__(self, *args, **kwargs)
    norms = _norms(self)
    extra = {"context_fn": functools.partial(_contexts, norms)} if norms else {}
    return torch.utils.checkpoint.checkpoint(nn.Module.__call__, self, *args, use_reentrant=False, **extra, **kwargs)


def _contexts(norms):
    return contextlib.nullcontext(), _running_stats_kept(norms)


@contextlib.contextmanager
def _running_stats_kept(norms):
    """The recomputation leaves batch norms' running statistics as the forward pass left them (it would update
    them a second time)."""
    saved = [(m, m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone()) for m in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, mean, var, count in saved:
                m.running_mean.copy_(mean)
                m.running_var.copy_(var)
                m.num_batches_tracked.copy_(count)


RUNNING = ("running_mean", "running_var", "num_batches_tracked")  # a batch norm's running statistics


def norms_kept_when_recomputed(module: nn.Module):
    """Hooks on module's batch norms that leave their running statistics as they were when a checkpoint
    recomputes them in the backward: DeepSpeed's pipeline checkpoints whole layers with its own function, whose
    recomputation would update them a second time. The recomputation updates copies, which the backward may read
    (the statistics themselves are not written once saved for it)."""
    held = {}

    def before(norm, args):
        if torch_private.in_backward():
            held[norm] = [getattr(norm, name) for name in RUNNING]
            for name in RUNNING:
                setattr(norm, name, getattr(norm, name).clone())

    def after(norm, args, out):
        for name, kept in zip(RUNNING, held.pop(norm, ())):
            setattr(norm, name, kept)
    for norm in _norms(module):
        norm.register_forward_pre_hook(before)
        norm.register_forward_hook(after)


def _norms(module: nn.Module) -> list:
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
