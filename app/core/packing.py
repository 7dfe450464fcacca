"""Packed rows must never see each other. transformers reads position ids that restart within a sequence as the
bounds of packed rows and keeps each row's attention inside it, on the attention implementations and model families
built on its masking utilities (eager, sdpa, flex_attention, and flash_attention_2/3 in a batch of one row only, for
Llama, Qwen, Mistral, Gemma, GPT-2, ...); a family that ignores them (OpenAI GPT, Mamba, ...) would let rows leak
into each other. So the run checks its own model and attention once, before training: a row's log-probabilities
packed after another row must equal those of the row alone. Every rank runs the same two forwards (ZeRO-3 gathers the weights for each).
"""
import torch

from app.ds.precision import compute_dtype
from app.errors import UserError


def batches(first: list, second: list, shape: tuple) -> tuple:
    """(packed, alone): (ids, positions) of shape (micro, block): first then second packed in row 0, and second
    alone in row 0; the other rows and the padding are sequences of their own."""
    made = []
    for rows in ([first, second], [second]):
        ids, positions, at = torch.zeros(shape, dtype=torch.long), torch.arange(shape[1]).repeat(shape[0], 1), 0
        for row in rows:
            ids[0, at:at + len(row)], positions[0, at:at + len(row)] = torch.tensor(row), torch.arange(len(row))
            at += len(row)
        positions[0, at:] = torch.arange(shape[1] - at)
        made.append((ids, positions))
    return made[0], made[1]


def leak(forward, first: list, second: list, shape: tuple) -> float:
    """How far second's next-token log-probabilities move when first is packed before it: 0 (to rounding) when
    the attention keeps packed rows apart. forward(ids, positions) -> logits."""
    packed, alone = batches(first, second, shape)
    with torch.no_grad():
        together = forward(*packed)[0, len(first):len(first) + len(second)].float().log_softmax(-1)
        apart = forward(*alone)[0, :len(second)].float().log_softmax(-1)
    moved = torch.where(together == apart, 0.0, (together - apart).abs())  # a padded vocabulary's -inf: unmoved
    return moved.nan_to_num(nan=float("inf")).max().item()


def check(engine, task, train_set):
    """Refuse, in one line, a model whose attention lets packed rows see each other."""
    rows, block = train_set.rows, train_set.block
    micro = engine.train_micro_batch_size_per_gpu()
    first, second = (rows.dataset[i]["input_ids"].tolist()[:block // 2] for i in range(2)) if len(rows) > 1 else \
        (rows.dataset[0]["input_ids"].tolist()[:block // 2],) * 2
    device = engine.device
    engine.eval()
    moved = leak(lambda ids, positions: engine(ids.to(device), positions.to(device)), first, second, (micro, block))
    engine.train()
    tolerance = 1e-3 if compute_dtype(engine) == torch.float32 else 1e-1
    if moved > tolerance:
        hf = engine.module.hf
        raise UserError(f"packing: {type(hf).__name__} with attention {hf.config._attn_implementation!r} lets packed "
                        f"rows see each other (a row's log-probabilities move by {moved:.3g} when another is packed "
                        f"before it); pass --packing off, or an --attention and model that keep them apart "
                        f"(docs/instruction-tuning.md, \"Packing\")")
