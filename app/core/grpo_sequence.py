"""GRPO's step on a rank that holds a slice of every sequence (sequence parallelism: app/core/sequence_step.py).

The N ranks of a group are one data-parallel replica: they load the same prompts.
- Sampling: each rank samples and scores its share of the group's completions whole, with transformers' own
  attention (app/ds/internals/sequence.py whole_sequences), and the group gathers them with their rewards: every
  rank then holds all of them, each reward function is called once a completion, and sampling takes a rank 1/N of
  the time it would alone. A completion's draws are its own (app/core/rollout.py), so it does not depend on which
  rank samples it.
- Training: each rank runs its slice of the sequences and takes the losses of the completion tokens its slice
  predicts, through the softmax of those positions alone. GRPO's loss is a weighted sum over tokens whose weights
  the whole completions give (their token counts, the step's tokens), so the slices' losses add up to the
  sequence's and nothing but the gradients crosses the ranks. The window's totals and the meters count the group's
  first rank alone for what every rank holds whole.
- The old policy's log-probabilities that a cycle of --num_iterations keeps are the group's sums: whole on every
  rank, so a resume on any layout reads the right ones."""
import torch

from app.core import grpo_loss, rollout
from app.core.grpo_step import GrpoStep, Part
from app.core.rewards import Asked
from app.core.sequence_step import Sliced
from app.ds import internals as ds_internals


class SequenceGrpoStep(Sliced, GrpoStep):
    """The GRPO step of a sequence-parallel rank (the task: app/core/grpo.py)."""

    def __init__(self, engine, task, compile_model: bool, board=None):
        super().__init__(engine, task, compile_model, board)
        self.replicas, self.counts = self.group.replicas, self.group.rank == 0

    def roll(self, prompts: torch.Tensor, lengths: torch.Tensor, u: torch.Tensor, how: rollout.Sampling,
             asked: Asked) -> tuple:
        """This rank's share of the rows sampled whole and scored, then every share gathered (the last share
        padded with repeats of the last row, sampled for equal shapes and neither scored nor kept) and the texts
        decoded from the gathered completions."""
        n, share = len(prompts), -(-len(prompts) // self.group.degree)
        wanted = torch.arange(self.group.rank * share, (self.group.rank + 1) * share)
        rows, real = wanted.clamp(max=n - 1), int((wanted < n).sum())
        with ds_internals.whole_sequences():
            completions, mask, truncated = self.sample(prompts[rows], lengths[rows], u[rows], how)
        scored = torch.zeros(share, len(self.task.rewards), dtype=torch.float64)
        if real:
            scored[:real] = self.scored(completions[:real], mask[:real], asked.rows(rows[:real].tolist()))[0]
        rolled = completions, mask, truncated, scored
        device = self.engine.device
        completions, mask, truncated, scored = (
            self.group.gather(x.to(device, torch.float64 if x.is_floating_point() else torch.long)).cpu()[:n]
            .to(x.dtype) for x in rolled)
        return completions, mask, truncated, scored, self.decoded(completions, mask)[1]

    def placed(self, ids: torch.Tensor, starts: torch.Tensor) -> tuple:
        """(each row's position on this slice that predicts its first completion token (maybe outside the slice),
        the slice's width) of sequences ids whose completions start at starts."""
        width = -(-ids.shape[1] // self.group.degree)
        return starts - 1 - self.group.rank * width, width

    def log_probs(self, on_device: tuple, logits) -> torch.Tensor:
        """(n, max_new) the log-probabilities of the completion tokens this rank's slice predicts (mine() says
        which; 0 for the others), logits(ids, positions) run on the slice alone. Only the slice's positions that
        predict completion tokens go through the softmax: a window of min(width, max_new) a row."""
        ids, completions, starts = on_device
        length = completions.shape[1]
        before, width = self.placed(ids, starts)
        k = min(width, length)
        window = before.clamp(0, width - k)[:, None] + torch.arange(k, device=ids.device)  # holds every such position
        taken = window - before[:, None]  # the completion token each position predicts
        held, taken = (taken >= 0) & (taken < length), taken.clamp(0, length - 1)
        sliced, positions, _ = self.group.slice([ids], ids)
        logp = grpo_loss.picked_logps(logits(sliced, positions), window, completions.gather(1, taken),
                                      self.task.how.temperature)
        return torch.zeros_like(completions, dtype=logp.dtype).scatter_add(1, taken, torch.where(held, logp, 0.0))

    def mine(self, on_device: tuple) -> torch.Tensor:
        """(n, max_new) True where this rank's slice holds the position that predicts the completion token."""
        ids, completions, starts = on_device
        before, width = self.placed(ids, starts)
        at = before[:, None] + torch.arange(completions.shape[1], device=starts.device)[None]
        return (at >= 0) & (at < width)

    def every_logp(self, on_device: tuple, logits) -> torch.Tensor:
        """The group's sum of its slices' log-probabilities: each token's is on one slice alone."""
        return self.group.whole(self.log_probs(on_device, logits))

    def my_tokens(self, on_device: tuple, logp: torch.Tensor, old: torch.Tensor, reference) -> tuple:
        """Another slice's tokens (logp 0 here) take a ratio of 1 and no KL term, and their losses are dropped."""
        mine = self.mine(on_device)
        old, reference = (None if x is None else torch.where(mine, x, logp.detach()) for x in (old, reference))
        return old, reference, mine.float()

    def part_loss(self, part: Part, totals: dict) -> tuple:
        """GrpoStep's, the loss scaled by the group's ZeRO-3 factor (Group.scale)."""
        loss, sums, weight = super().part_loss(part, totals)
        return loss * self.group.scale, sums, weight
