"""The arithmetic of GRPO and its variants, as TRL's GRPOTrainer does it: rewards combined, group advantages, the
clipped per-token objective with its KL term, and each loss's normalisation over a whole optimizer step."""
import torch

LOSSES = ("dapo", "grpo", "dr_grpo")


def combined(rewards: torch.Tensor, weights: list) -> torch.Tensor:
    """Each completion's reward: the weighted sum of its functions' rewards, None (NaN) left out; NaN where every
    function said None (such a completion is left out of its group's mean and std, its advantage 0)."""
    weighted = rewards * torch.tensor(weights, dtype=rewards.dtype)
    total = torch.nansum(weighted, 1)
    return total.masked_fill(rewards.isnan().all(1), float("nan"))


def group_stats(rewards: torch.Tensor, group: int) -> tuple:
    """(mean, std) of each group of `group` consecutive completions, NaN left out; the std with n - 1, NaN below 2."""
    r = rewards.view(-1, group)
    scored = ~r.isnan()
    n = scored.sum(1)
    mean = torch.where(scored, r, 0.0).sum(1) / n.clamp(min=1)
    mean = mean.masked_fill(n == 0, float("nan"))
    square = torch.where(scored, (r - mean[:, None]) ** 2, 0.0).sum(1)
    std = (square / (n - 1).clamp(min=1)).sqrt().masked_fill(n < 2, float("nan"))
    return mean, std


def advantages(rewards: torch.Tensor, group: int, scale: str, batch_std: float) -> torch.Tensor:
    """(r - its group's mean), divided by the group's std (group), by the step's std (batch) or not (none), plus
    1e-4; 0 where the reward or the std is NaN."""
    mean, std = group_stats(rewards, group)
    centred = rewards.view(-1, group) - mean[:, None]
    if scale == "group":
        centred = centred / (std[:, None] + 1e-4)
    elif scale == "batch":
        centred = centred / (batch_std + 1e-4)
    return torch.nan_to_num(centred.reshape(-1), nan=0.0)


def token_logps(logits: torch.Tensor, completions: torch.Tensor, starts: torch.Tensor,
                temperature: float) -> torch.Tensor:
    """(rows, length) log-probabilities, in fp32, of each completion's tokens under logits of the whole sequences
    (prompt of starts[r] tokens, then the completion), at the sampling temperature."""
    length = completions.shape[1]
    at = (starts[:, None] - 1 + torch.arange(length, device=starts.device)[None]).clamp(max=logits.shape[1] - 1)
    return picked_logps(logits, at, completions, temperature)


def picked_logps(logits: torch.Tensor, at: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """(rows, k) log-probabilities, in fp32, of tokens (rows, k) under the logits (rows, positions, vocab) at
    positions at (rows, k), at the sampling temperature: only those positions go through the softmax."""
    picked = logits.gather(1, at[..., None].expand(-1, -1, logits.shape[-1]))
    return (picked.float() / temperature).log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)


def token_losses(logp: torch.Tensor, old: torch.Tensor, advantage: torch.Tensor, low: float, high: float,
                 beta: float, reference: torch.Tensor = None) -> tuple:
    """(per-token loss, KL (None without beta), clipped below, clipped above): -min(rho A, clip(rho, 1 - low,
    1 + high) A) + beta KL, rho = exp(logp - old), KL = exp(ref - logp) - (ref - logp) - 1 (k3)."""
    rho = torch.exp(logp - old)
    a = advantage[:, None]
    loss = -torch.min(rho * a, rho.clamp(1 - low, 1 + high) * a)
    below, above = (rho < 1 - low) & (a < 0), (rho > 1 + high) & (a > 0)
    kl = None
    if beta:
        gap = reference - logp
        kl = torch.exp(gap) - gap - 1
        loss = loss + beta * kl
    return loss, kl, below.float(), above.float()


def normalised(kind: str, loss: torch.Tensor, mask: torch.Tensor, share: torch.Tensor, per_token: float,
               length: int) -> torch.Tensor:
    """The micro batch's part of an optimizer step's loss, scaled so that DeepSpeed's mean over its ranks and
    accumulation gives the step's loss however it is split. share: each completion's weight (its prompt's loader
    weight over the group size; 0 for padding); per_token: dapo's weight of one token, data-parallel replicas
    x accumulation over the step's tokens on every replica.

    dapo: the sum over every completion token of the step / those tokens; grpo: the mean over completions of
    their token means; dr_grpo: the sum over completion tokens / (completions x --max_completion_length)."""
    summed = (loss * mask).sum(1)
    if kind == "dapo":
        return (summed * (share > 0)).sum() * per_token
    if kind == "grpo":
        return (summed / mask.sum(1).clamp(min=1) * share).sum()
    return (summed / length * share).sum()
