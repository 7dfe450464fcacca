"""GRPO's step on a rank that holds a slice of every sequence (sequence parallelism: app/core/sequence_step.py).

The N ranks of a group are one data-parallel replica: they load the same prompts.
- Sampling: each rank samples its share of the group's completions whole, with transformers' own attention
  (app/ds/internals/sequence.py whole_sequences), and the group gathers them: every rank then holds all of them,
  and sampling takes a rank 1/N of the time it would alone. A completion's draws are its own (app/core/rollout.py),
  so it does not depend on which rank samples it.
- Training: each rank runs its slice of the sequences and takes the losses of the completion tokens its slice
  predicts. GRPO's loss is a weighted sum over tokens whose weights the whole completions give (their token counts,
  the step's tokens), so the slices' losses add up to the sequence's and nothing but the gradients crosses the
  ranks. The window's totals and the meters count the group's first rank alone for what every rank holds whole."""
import torch

from app.core import grpo_loss, rollout
from app.core.grpo_step import GrpoStep, Part
from app.core.sequence_step import Sliced
from app.ds import internals as ds_internals


class SequenceGrpoStep(Sliced, GrpoStep):
    """The GRPO step of a sequence-parallel rank (the task: app/core/grpo.py)."""

    def __init__(self, engine, task, compile_model: bool, board=None):
        super().__init__(engine, task, compile_model, board)
        self.replicas, self.counts = self.group.replicas, self.group.rank == 0

    def sample(self, prompts: torch.Tensor, lengths: torch.Tensor, u: torch.Tensor, how: rollout.Sampling) -> tuple:
        """This rank's share of the rows sampled whole, then every share gathered (the last padded with repeats of
        its last row, dropped)."""
        n, share = len(prompts), -(-len(prompts) // self.group.degree)
        rows = torch.arange(self.group.rank * share, (self.group.rank + 1) * share).clamp(max=n - 1)
        with ds_internals.whole_sequences():
            sampled = super().sample(prompts[rows], lengths[rows], u[rows], how)
        device = self.engine.device
        return tuple(self.group.gather(x.to(device, torch.long)).cpu()[:n].to(x.dtype) for x in sampled)

    def first_position(self, ids: torch.Tensor) -> int:
        """The position of this rank's slice's first token (the sequences padded to a multiple of N)."""
        return self.group.rank * -(-ids.shape[1] // self.group.degree)

    def log_probs(self, on_device: tuple, logits) -> torch.Tensor:
        """(n, max_new) the log-probabilities of the completion tokens this rank's slice predicts (mine() says
        which), logits(ids, positions) run on the slice alone."""
        ids, completions, starts = on_device
        ids, positions, _ = self.group.slice([ids], ids)
        return grpo_loss.token_logps(logits(ids, positions), completions, starts - self.first_position(on_device[0]),
                                     self.task.how.temperature)

    def mine(self, on_device: tuple) -> torch.Tensor:
        """(n, max_new) 1 where this rank's slice holds the position that predicts the completion token."""
        ids, completions, starts = on_device
        width = -(-ids.shape[1] // self.group.degree)
        at = starts[:, None] - 1 + torch.arange(completions.shape[1], device=starts.device)[None]
        at = at - self.first_position(ids)
        return ((at >= 0) & (at < width)).float()

    def part_loss(self, part: Part, totals: dict) -> tuple:
        """GrpoStep's, the loss scaled by the group's ZeRO-3 factor (Group.scale)."""
        loss, sums, weight = super().part_loss(part, totals)
        return loss * self.group.scale, sums, weight
