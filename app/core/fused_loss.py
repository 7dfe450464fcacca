"""The next-token loss of a long sequence without its whole logits (--tiled): the output layer and the cross entropy
run over tiles of the sequence, one tile's logits alive at a time, each tile recomputed in the backward pass.

At long sequences the logits (tokens x vocabulary, and their fp32 copy for the cross entropy) outgrow everything
else: 32,768 tokens of a 128K vocabulary are 16 GiB in fp32. Each tile runs under torch's non-reentrant checkpoint,
which keeps only the tile's inputs and recomputes the tile inside the one backward pass. DeepSpeed's
TiledFusedLogitsLoss was measured for this and not taken: it makes the output layer's gradient inside its forward
pass, unscaled by the gradient that reaches it (DeepSpeed's 1 / accumulation steps), in a backward of its own, so a
head tied to the input embedding gets its gradient twice (ZeRO 1-2 refuse that), and it reads the incoming gradient
on the host at every step.

The model returns TokenSums, the per-sample sums the task's loss and accuracy turn into means
(app/core/tasks.py), or preference tuning into its answers' log-probabilities (target_logps, which takes whole
logits alike): the same values as from whole logits, to rounding.
"""
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from app.data.chat import IGNORE


class TokenSums(NamedTuple):
    """What a model whose logits are tiled returns in their place: each sample's summed next-token cross entropy
    (fp32) and count of next tokens predicted right, over its counted targets."""
    loss: torch.Tensor
    right: torch.Tensor


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """(B, T) targets of (B, T) labels: position t's is label t + 1, the last position's IGNORE."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE)


def counted_next_tokens(labels: torch.Tensor) -> torch.Tensor:
    """How many next tokens each sample predicts (labels of IGNORE, prompts and padding, are left out), at least 1."""
    return (labels[:, 1:] != IGNORE).sum(1).clamp(min=1)


def target_logps(logits, targets: torch.Tensor) -> torch.Tensor:
    """(sequences, 2): each sequence's summed log-probability (fp32) of the targets its positions predict, and how
    many are counted (a slice of a sequence: its share of both); logits: the positions' logits, or their
    TokenSums."""
    counted = (targets != IGNORE).sum(1).float()
    if isinstance(logits, TokenSums):  # the summed cross entropy of the counted targets
        return torch.stack([-logits.loss, counted], 1)
    logp = -F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none", ignore_index=IGNORE)
    return torch.stack([logp.view(len(targets), -1).sum(1), counted], 1)


def tiles_for(tokens: int, hidden: int) -> int:
    """Tiles of a sequence: one per hidden width of tokens (DeepSpeed's rule for its tiled compute), at least 1."""
    return max(1, math.ceil(tokens / hidden))


def masked_padding(logits: torch.Tensor, real_vocab: int) -> torch.Tensor:
    """logits with the columns of a padded vocabulary (from real_vocab on; 0: none) at -inf, so that they never win
    nor take probability. Out of place: compiled under ZeRO-3, the output layer's hooks end a graph just before this,
    and masked in place the next graph handed back a copy while the input it masked stayed alive, so the step held
    its logits twice (tests/e2e/test_compiling.py)."""
    if not real_vocab:
        return logits
    return logits.masked_fill(torch.arange(logits.shape[-1], device=logits.device) >= real_vocab, float("-inf"))


def _tile(head, hidden: torch.Tensor, targets: torch.Tensor, real_vocab: int) -> tuple:
    """(each sample's summed cross entropy, its right predictions) over one tile of positions."""
    logits = masked_padding(head(hidden), real_vocab)
    losses = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none", ignore_index=IGNORE)
    right = (logits.argmax(-1) == targets) & (targets != IGNORE)
    return losses.view(len(targets), -1).sum(1), right.sum(1)


def token_sums(hidden: torch.Tensor, head, targets: torch.Tensor, real_vocab: int = 0) -> TokenSums:
    """TokenSums of hidden states (B, T, H) through the output layer head against targets (B, T), tile by tile."""
    step = math.ceil(targets.shape[1] / tiles_for(targets.shape[1], hidden.shape[-1]))
    loss = right = 0
    for start in range(0, targets.shape[1], step):
        part = (hidden[:, start:start + step], targets[:, start:start + step])
        if torch.is_grad_enabled() and step < targets.shape[1]:
            tile_loss, tile_right = checkpoint(_tile, head, *part, real_vocab, use_reentrant=False)
        else:
            tile_loss, tile_right = _tile(head, *part, real_vocab)
        loss, right = loss + tile_loss, right + tile_right
    return TokenSums(loss, right)


def hf_token_sums(model, input_ids: torch.Tensor, second, targets: torch.Tensor) -> TokenSums:
    """TokenSums of HFLogits model: its transformers model's final hidden states, then its output layer by tiles."""
    from peft import PeftModel
    hf = model.hf.get_base_model() if isinstance(model.hf, PeftModel) else model.hf
    hidden = hf.base_model(input_ids=input_ids, **{model.second: second}).last_hidden_state
    return token_sums(hidden, hf.get_output_embeddings(), targets, model.real_vocab)
