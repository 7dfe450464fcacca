"""Completions sampled inside a run (online RL): HF generate with a sampler whose every draw belongs to its row, so
that a prompt's completions depend on the seed, the step, the row and their number in the group, never on the rank,
the world size or the micro batch they are generated in (a resumed run generates what the unbroken one did).

Under ZeRO-3 on several ranks each forward gathers the weights from all of them, so every rank must run the same
forwards: each rank gives the same number of prompts a call (the loader pads its share), of one shape (left-padded
to the data's longest prompt), and HF's synced_gpus keeps a rank whose rows have ended stepping until all ranks'
have (transformers turns it on by itself only where it sees DeepSpeed's config, which the app does not leave
behind)."""
import hashlib
from dataclasses import dataclass

import torch

from app.ds import internals as ds_internals

MIX = 2 ** 63 - 1


def draws(seed: int, step: int, rows: list, group: int, length: int) -> torch.Tensor:
    """(rows x group, length) uniform draws in [0, 1), float64: row r's completion j from its own generator."""
    out = torch.empty(len(rows) * group, length, dtype=torch.float64)
    for k, (row, j) in enumerate((row, j) for row in rows for j in range(group)):
        key = hashlib.sha256(f"{seed}/{step}/{int(row)}/{j}".encode()).digest()
        out[k] = torch.rand(length, dtype=torch.float64,
                            generator=torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & MIX))
    return out


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn: temperature (0: greedy), top_k (0: all), top_p (1: all), the most new tokens."""
    temperature: float
    top_k: int
    top_p: float
    max_new: int


def choose(scores: torch.Tensor, u: torch.Tensor, how: Sampling) -> torch.Tensor:
    """The token each row draws from its scores (rows, vocab) with its uniform u (rows,): the first whose cumulative
    probability passes u, after the temperature, top-k and top-p; the argmax when greedy."""
    logits = scores.double()
    if how.temperature == 0:
        return logits.argmax(-1)
    logits = logits / how.temperature
    if 0 < how.top_k < logits.size(-1):
        kth = logits.topk(how.top_k, -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if how.top_p < 1:
        ordered, order = probs.sort(dim=-1, descending=True, stable=True)
        before = ordered.cumsum(-1) - ordered  # the mass of the more likely tokens
        probs = probs.scatter(-1, order, ordered.masked_fill(before >= how.top_p, 0.0))
    total = probs.cumsum(-1)
    return (total <= u[:, None] * total[:, -1:]).sum(-1).clamp(max=logits.size(-1) - 1)


class Sampler:
    """A logits processor for HF generate: each row's next token by choose(), with the row's draw for that position;
    every other token -inf, so generate's greedy pick takes it. vocab: the tokens the tokenizer has (rows of a
    padded embedding never drawn)."""

    def __init__(self, u: torch.Tensor, start: int, vocab: int, how: Sampling):
        self.u, self.start, self.vocab, self.how = u, start, vocab, how

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        position = input_ids.shape[1] - self.start
        token = choose(scores[:, :self.vocab], self.u[:, position].to(scores.device), self.how)
        picked = torch.full_like(scores, float("-inf"))
        return picked.scatter(-1, token[:, None], 0.0)


def cache_bytes(config, rows: int, tokens: int, element: int) -> int:
    """Bytes of the key-value cache HF generate keeps for rows sequences of tokens (prompt and completion), in a
    dtype of element bytes: a key and a value per layer, per key-value head (grouped-query attention shares them)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * tokens * rows * element


UNSHAPED = dict(repetition_penalty=1.0, encoder_repetition_penalty=1.0, no_repeat_ngram_size=0,
                encoder_no_repeat_ngram_size=0, min_length=0, min_new_tokens=0, remove_invalid_values=False)
"""Each setting of HF generate that reshapes the scores, at the value that changes nothing: given, it is not taken
from the model's own generation_config.json (a Qwen instruct model's repetition penalty), so the Sampler draws
from the model's distribution, the one the loss scores."""


def generation_config(max_new: int, eos: tuple, pad: int):
    """HF generate's settings for the completions: greedy over the Sampler's scores (its draw is the pick), up to
    max_new tokens, nothing else shaping the scores (UNSHAPED)."""
    from transformers import GenerationConfig
    return GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_new, eos_token_id=list(eos),
                            pad_token_id=pad, use_cache=True, **UNSHAPED)


def sample(engine, prompts: torch.Tensor, lengths: torch.Tensor, u: torch.Tensor, how: Sampling, vocab: int,
           eos: tuple, pad: int, synced: bool, gather: bool = False) -> tuple:
    """(completions (rows, max_new) padded after their end, mask: their tokens up to and with the first of eos (the
    tokens that end one), truncated: rows that reached max_new without one); prompts left-padded (rows, P), lengths
    their tokens.
    gather: under ZeRO-3, the whole model gathered once for the call (every rank calls together), so no decoding
    step gathers and the ranks need not step in lock-step; else synced keeps them so."""
    from transformers import LogitsProcessorList
    width = prompts.shape[1]
    attention = (torch.arange(width)[None] >= width - lengths[:, None]).long()
    config = generation_config(how.max_new, eos, pad)
    hf, device, training = engine.module.hf, engine.device, engine.module.training
    engine.eval()
    try:
        with torch.no_grad(), ds_internals.whole_weights(engine, gather), ds_internals.autocast_of(engine):
            out = hf.generate(input_ids=prompts.to(device), attention_mask=attention.to(device),
                              generation_config=config, synced_gpus=synced and not gather,
                              logits_processor=LogitsProcessorList([Sampler(u, width, vocab, how)]))
    finally:
        engine.train(training)
    new = torch.full((len(prompts), how.max_new), pad, dtype=torch.long)
    new[:, :out.shape[1] - width] = out[:, width:].cpu()
    mask, truncated = ends(new, eos)
    return new.masked_fill(~mask, pad), mask, truncated


def ends(completions: torch.Tensor, eos: tuple) -> tuple:
    """(mask: each completion's tokens up to and with its first of eos, truncated: those without one)."""
    ended = torch.isin(completions, torch.tensor(eos, dtype=completions.dtype))
    length = completions.shape[1]
    first = torch.where(ended.any(1), ended.float().argmax(1), torch.full((len(completions),), length))
    return torch.arange(length)[None] <= first[:, None], ~ended.any(1)
