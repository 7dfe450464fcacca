"""The step of a rank that holds a slice of every sequence (sequence parallelism, DeepSpeed's Ulysses:
app/parallel/sequence_parallel.py), and the group of ranks that share the sequences.

The N ranks of a group are one data-parallel replica: they load the same micro batch, and each takes its slice of
the positions. The next-token targets are shifted over the whole sequence first, so the last token of a slice
predicts the first token of the next.

Two kinds of loss split over the slices:
- a next-token loss is a sum over tokens: a rank's loss is its slice's share of each sample's mean (its tokens'
  losses over the sample's counted tokens in the whole sequence), and nothing crosses the ranks but the gradients;
- a loss of each sequence's whole sums (preference tuning's log-probability of an answer) takes the group's sum of
  the slices' sums first (Group.whole). Every rank of the group then computes the same loss, and each backpropagates
  it through its own slice alone, so the sum over the ranks of their gradients is the sequence's.

DeepSpeed sums the gradients over all ranks and divides by the replicas, so a step's gradient is the one SP=1 takes
on the same global batch.
"""
import torch
import torch.nn.functional as F

from app.core.fused_loss import TokenSums, target_logps
from app.core.fused_loss import counted_next_tokens as counted  # over each sample's whole sequence
from app.core.step import TrainStep
from app.data.chat import IGNORE
from app.distributed import dist


def sliced(inputs: list, labels: torch.Tensor, degree: int, rank: int) -> tuple:
    """(ids, positions, next-token targets) of this rank's slice of the micro batch; the sequence padded at its end
    to a multiple of degree with untrained tokens, at the last real position (after every real token, so causal
    attention keeps them from the real ones, and within a learned position table)."""
    ids, real = inputs[0], inputs[0].shape[1]
    length = -(-real // degree) * degree
    pad = length - real
    targets = F.pad(labels[:, 1:], (0, pad + 1), value=IGNORE)
    ids = F.pad(ids, (0, pad), value=0)
    positions = torch.arange(length, device=ids.device).clamp(max=real - 1).expand(ids.shape[0], -1)
    part = slice(rank * length // degree, (rank + 1) * length // degree)
    return ids[:, part], positions[:, part], targets[:, part]


class Group:
    """This rank's place among the ranks that share each sequence (the engine's sequence-parallel group)."""

    def __init__(self, engine):
        self.degree, self.group = engine.sequence_parallel_size, engine.seq_parallel_group
        self.rank = dist.rank() % self.degree  # DeepSpeed's groups: consecutive ranks
        # DeepSpeed 0.19.8's ZeRO-3 reduce-scatter averages gradients over every rank, where ZeRO 0-2 (and its own
        # all-reduce path) divide by the data-parallel replicas alone: its gradients come out 1/degree of the
        # sequence's, which Adam hides but clipping does not. The loss is scaled to make up for it.
        self.scale = self.degree if engine.zero_optimization_stage() == 3 else 1
        self.replicas, self.replica = dist.world_size() // self.degree, dist.rank() // self.degree

    @staticmethod
    def of(engine):
        """The engine's Group, or None where each rank holds whole sequences."""
        return Group(engine) if engine.sequence_parallel_size > 1 else None

    def slice(self, inputs: list, labels: torch.Tensor) -> tuple:
        """(ids, positions, next-token targets) of this rank's slice."""
        return sliced(inputs, labels, self.degree, self.rank)

    def whole(self, sums: torch.Tensor) -> torch.Tensor:
        """Each sequence's sums (rows) over the whole sequence, from this rank's slice's."""
        return dist.group_sum(sums, self.group)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Every rank of the group's rows (one shape on each), in rank order."""
        return dist.group_gather(rows, self.group)

    def counted(self, values: torch.Tensor) -> torch.Tensor:
        """What the meters count (weights, or sums every rank of the group holds whole): the group's first rank's
        alone (the others hold the same samples)."""
        return values if self.rank == 0 else torch.zeros_like(values)


class Sliced:
    """What a step on a rank's slice of every sequence adds to the TrainStep it is mixed into (before it): the
    group, the model on the slice (compiled or eager), the loss scaled for ZeRO-3, and meters that count the group's
    first rank alone."""

    def __init__(self, engine, task, compile_model: bool, board=None):
        self.group = Group(engine)
        super().__init__(engine, task, compile_model, board)
        if self.compiler is not None:
            self.compiler.forward = self.forward

    def forward(self, engine, loss, inputs: list, labels: torch.Tensor) -> tuple:
        """(the slice's logits or TokenSums, each sample's loss terms on the slice)."""
        raise NotImplementedError

    def on_slice(self, engine, inputs: list, labels: torch.Tensor) -> tuple:
        """(the model's output on this rank's slice: its logits, or their TokenSums where the output layer runs
        tiled with the loss; the slice's next-token targets)."""
        ids, positions, targets = self.group.slice(inputs, labels)
        return engine(ids, positions, targets if self.task.fused_logits else None), targets

    def logits_and_losses(self, inputs: list, labels: torch.Tensor) -> tuple:
        if self.compiler is not None:
            return self.compiler(inputs, labels)
        return self.forward(self.engine, None, inputs, labels)

    def with_targets(self, inputs: list, labels: torch.Tensor) -> list:
        return inputs  # forward slices the targets with the sequence

    def batch_loss(self, batch) -> tuple:
        """The step's batch_loss, its loss scaled by the group's ZeRO-3 factor (Group.scale)."""
        loss, sums, weights = super().batch_loss(batch)
        return loss * self.group.scale, sums, weights

    def meter_weights(self, weights: torch.Tensor) -> torch.Tensor:
        return self.group.counted(weights)


class SequenceStep(Sliced, TrainStep):
    """The step of a next-token task's sequence-parallel rank: the model on its slice, the loss its share of each
    sample's mean; only the group's first rank counts the samples for the meters (the others add their losses'
    shares alone)."""

    def forward(self, engine, loss, inputs: list, labels: torch.Tensor) -> tuple:
        """(this slice's logits, or their TokenSums where the task fuses them with the loss; each sample's share of
        its mean next-token loss)."""
        logits, targets = self.on_slice(engine, inputs, labels)
        return logits, -target_logps(logits, targets)[:, 0] / counted(labels)

    def correct(self, logits, labels: torch.Tensor) -> torch.Tensor:
        """Each sample's share of its next tokens predicted right, on this slice."""
        if isinstance(logits, TokenSums):
            return logits.right / counted(labels)
        targets = self.group.slice([labels], labels)[2]
        right = (logits.argmax(-1) == targets) & (targets != IGNORE)
        return right.sum(1) / counted(labels)
