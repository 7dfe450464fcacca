"""Tiled MLPs for long sequences (--tiled): each transformer block's MLP runs over tiles of the sequence through
DeepSpeed's own ALST autograd function TiledMLP (deepspeed/runtime/sequence_parallel/ulysses_sp.py, written for
DeepSpeed 0.19.8), so the MLP's wide intermediate activations are never alive whole.

Why: at long sequences what fills a GPU is not the weights but the MLP's intermediate tensors (several times the
width, each saved for the backward pass). TiledMLP keeps only each MLP's input and recomputes one tile at a time in
the backward pass (one more MLP forward).

The MLPs are patched as instances (a forward bound on each module object), never a transformers class, so nothing
else in the process changes, and names and state dict keys stay as they were. TiledMLP takes the MLP's parameters
as DeepSpeed's compute_params: under ZeRO, DeepSpeed then hands each gradient to its reduction once, after the last
tile, rather than once per tile.
"""
import functools
import math
import types

import torch
from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
from torch import nn

from app.core import fused_loss, models
from app.distributed import dist
from app.errors import UserError

DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def pieces(rows: int, shards: int) -> int:
    """How many pieces torch.chunk really cuts `rows` into when asked for `shards` (fewer when they do not divide
    evenly, e.g. 20 rows in 6 asked: 5 pieces of 4)."""
    rows = max(rows, 1)
    size = -(-rows // max(1, min(shards, rows)))
    return -(-rows // size)


def tile_mlps(model: nn.Module, shards: int = 0) -> list:
    """Make every transformer block's MLP run its forward through DeepSpeed's TiledMLP over `shards` tiles of the
    sequence (0: fused_loss.tiles_for each call's length and width); the MLPs tiled ([] when shards is 1: nothing
    changes)."""
    if shards == 1:
        return []
    blocks = models.named_blocks(model)
    if not blocks:
        raise UserError("tiled MLPs need a transformers model made of blocks; this model names none, so train it "
                        "without tiling")
    found = [_mlp_of(block) for block in blocks]
    for mlp in found:  # bound on the instance (deepcopy rebinds it to the copy), a plain function torch.compile traces
        mlp.tiles = shards
        mlp.forward = types.MethodType(_tiled_forward, mlp)
    return found


def _mlp_of(block: nn.Module) -> nn.Module:
    """The block's `mlp`, refused in one line where tiles cannot stand in for it."""
    mlp = getattr(block, "mlp", None)
    name = type(block).__name__
    if not isinstance(mlp, nn.Module):
        raise UserError(f"tiled MLPs: {name} has no `mlp` module to tile; train this model without tiling")
    if hasattr(mlp, "experts"):  # a router's choices and its auxiliary outputs are not a per-token function
        raise UserError(f"tiled MLPs: {name}'s mlp is a mixture of experts ({type(mlp).__name__}), which TiledMLP "
                        f"does not split; train this model without tiling")
    dropped = sorted({m.p for m in mlp.modules() if isinstance(m, DROPOUTS) and m.p > 0})
    if dropped:  # the backward pass recomputes each tile and would draw other dropout masks than the forward did
        raise UserError(f"tiled MLPs: {name}'s mlp has dropout (p={dropped[0]}), which the tiles' recomputation "
                        f"would draw differently; set the model's dropout to 0 or train without tiling")
    return mlp


def _tiled_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The MLP's own (class) forward over mlp.tiles tiles of x's sequence dimension, through DeepSpeed's TiledMLP."""
    rows = math.prod(x.shape[:-1])
    # DeepSpeed marks the compute params' gradients ready on its last tile index only: ask for as many tiles as
    # torch.chunk will make, or ZeRO would never reduce them
    count = pieces(rows, mlp.tiles or fused_loss.tiles_for(x.shape[-2], x.shape[-1]))
    if count == 1:
        return _class_forward(mlp, x)
    device = x.device.type
    cast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    return TiledMLP.apply(functools.partial(_class_forward, cast=cast), mlp, x, count, list(mlp.parameters()))


def _class_forward(mlp: nn.Module, x: torch.Tensor, cast: torch.dtype = None) -> torch.Tensor:
    """The MLP's class forward on one tile, under the autocast dtype its forward pass ran in (cast, None: none)."""
    x = x.contiguous()  # TiledMLP's forward slices the sequence of a whole batch: a strided tile GPT-2 cannot view
    if cast is None:
        return type(mlp).forward(mlp, x)
    with torch.autocast(x.device.type, dtype=cast):  # TiledMLP's backward recomputes outside the caller's autocast
        return type(mlp).forward(mlp, x)


def check_layout(choice: str, ranks):
    """--tiled on under pipeline stages or tensor parallelism, refused in one line before the data is read."""
    if choice == "on" and (ranks.split or ranks.tensor > 1):
        raise UserError("--tiled on runs under data parallel, ZeRO 0-3 and sequence parallelism, not pipeline "
                        "stages or tensor parallelism; pass --tiled off")


def for_run(model: nn.Module, task, sequence: int, model_name: str):
    """--tiled on the run's model: on tiles every block's MLP and, where the task's loss takes them
    (task.tiled_loss), the output layer with the loss (app/core/fused_loss.py); auto does so under sequence
    parallelism where the model allows it (else says why not); off leaves them whole."""
    choice = task.settings.tiled
    wanted = choice == "on" or (choice == "auto" and sequence > 1)
    transformers_model = hasattr(model, "hf")  # else no blocks of MLPs, no output layer of its own
    task.fused_logits = wanted and transformers_model and task.tiled_loss and not _own_logits(model)
    if choice == "on" and not transformers_model:
        raise UserError(f"--tiled on: {model_name} is not a transformers model; pass --tiled off")
    if not (wanted and transformers_model):
        return
    try:
        tile_mlps(model)
    except UserError as e:
        if choice == "on":
            raise
        dist.print0(f"tiled: MLPs whole ({e})")


def describe(model: nn.Module, fused_logits: bool) -> str:
    """The start-up line of a run whose MLPs or output layer are tiled ('' where none is)."""
    tiles = [block.mlp for block in models.named_blocks(model) if hasattr(getattr(block, "mlp", None), "tiles")]
    said = [f"{len(tiles)} MLPs (DeepSpeed TiledMLP)"] if tiles else []
    said += ["the output layer with the loss (never the whole logits)"] if fused_logits else []
    if not said:
        return ""
    return (f"tiled: {' and '.join(said)} over tiles of the sequence, one per hidden width of tokens; each tile "
            f"recomputed in the backward pass")


def _own_logits(model: nn.Module) -> str:
    """The config key of a step the model takes on its logits past its output layer (Gemma 2's soft cap, Cohere's,
    Granite's and Falcon-H1's scales), which the tiled loss would skip: its logits are then kept whole ('' where
    none)."""
    config = model.hf.config
    for key, plain in (("final_logit_softcapping", None), ("logit_scale", 1.0), ("logits_scaling", 1.0),
                       ("lm_head_multiplier", 1.0)):
        if getattr(config, key, plain) not in (None, plain):
            return key
    return ""
