"""The reference model of preference tuning when it is not the policy with its adapters off: a frozen copy built as
the policy is, and the reference's log-probabilities computed once (--reference precompute) and kept beside the
tokenized data, keyed by the data, the base model and the precision, so a resumed run, or one on another world
size, reads them instead."""
import contextlib
import hashlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from app.checkpoint.save import atomic_write
from app.distributed import dist
from app.core.fused_loss import TokenSums, next_token_targets, target_logps
from app.core.tasks import TextTask
from app.data.chat import IGNORE
from app.ds import internals as ds_internals
from app.ds import run_dict

FILE = "reference-logps-{}.json"


def answer_logps(logits, labels: torch.Tensor) -> torch.Tensor:
    """(sequences, 2): each sequence's log-probability of its labelled tokens (summed, in fp32) and how many
    there are (at least 1); logits: the sequences' logits, or the TokenSums of an output layer tiled with the loss
    (app/core/fused_loss.py)."""
    shifted = logits if isinstance(logits, TokenSums) else logits[:, :-1]  # TokenSums: of next-token targets
    return counted_at_least_one(target_logps(shifted, labels[:, 1:]))


def counted_at_least_one(logps: torch.Tensor) -> torch.Tensor:
    """(sequences, 2) log-probabilities and counts, a count of 0 (no answer token) taken as 1."""
    return torch.stack([logps[:, 0], logps[:, 1].clamp(min=1)], 1)


def frozen_copy(build, ds: dict, replicas: int):
    """An engine of the base model for the reference alone: built as the policy was (build(dict) -> the model: the
    same weights; under ZeRO-3 partitioned as they are made), then given to DeepSpeed without an optimizer, in eval
    mode."""
    import deepspeed
    ref = run_dict.for_reference(ds, replicas)
    model = build(ref)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=ref)
    engine.eval()
    return engine


def _key(sets, base: str, dtype: torch.dtype) -> str:
    fingerprints = [pairs.dataset._fingerprint for pairs in sets]
    return hashlib.sha256(repr((fingerprints, base, str(dtype))).encode()).hexdigest()[:24]


def _place(sets, output_dir: Path, key: str) -> Path:
    """Beside the tokenized training pairs in the datasets cache, else (data held in memory) in output_dir."""
    cached = sets[0].dataset.cache_files
    folder = Path(cached[0]["filename"]).parent if cached else Path(output_dir)
    return folder / FILE.format(key)


def _compute(reference, pairs, micro: int) -> list:
    """[[chosen, rejected]] log-probabilities of every pair: each data-parallel replica computes every replicas-th
    pair, micro pairs at a time, all ranks the same number of forwards (ZeRO-3 gathers in each), then they are summed
    across ranks (of a sequence-parallel group, the first rank's alone)."""
    share, shares, counts = reference.share()
    mine = list(range(share, len(pairs), shares))
    padded = mine + [mine[0] if mine else 0] * (-(-len(pairs) // shares) - len(mine))  # repeats, not kept
    table = torch.zeros(len(pairs), 2, dtype=torch.float64)
    device = reference.engine.device
    for start in range(0, len(padded), micro):
        items = [pairs[i] for i in padded[start:start + micro]]
        ids = torch.stack([x for x, _ in items]).to(device).flatten(0, 1)
        labels = torch.stack([y[0] for _, y in items]).to(device).flatten(0, 1)
        logps = reference(ids, labels).view(-1, 2).double().cpu()
        kept = mine[start:start + micro]
        if counts:
            table[kept] = logps[:len(kept)]
    return [list(pair) for pair in torch.tensor(dist.host_sum(table.flatten().tolist())).view(-1, 2).tolist()]


def precompute(reference_of, sets, base: str, dtype, micro: int, output_dir: Path):
    """Give each PairRows of sets its reference log-probabilities: read from the file of this data, base and
    precision when there is one, else computed with reference_of() (called only then) and written there."""
    key = _key(sets, base, dtype)
    path = _place(sets, output_dir, key)
    found = dist.broadcast_object(json.loads(path.read_text()) if dist.is_main() and path.is_file() else None)
    if found is None:
        reference = reference_of()
        found = {"base": base, "dtype": str(dtype), "sets": [_compute(reference, pairs, micro) for pairs in sets]}
        if dist.is_main():
            atomic_write(path, json.dumps(found))
        dist.print0(f"reference: log-probabilities of {sum(map(len, sets))} pairs computed once and kept in {path}")
    else:
        dist.print0(f"reference: log-probabilities of {sum(map(len, sets))} pairs read from {path}")
    for pairs, table in zip(sets, found["sets"]):
        pairs.add_reference(table)


class Reference:
    """The reference's logits, or log-probabilities of a micro batch's answers, under no_grad, eager, in eval mode.
    engine: the policy's engine (adapters_off: its LoRA adapters switched off) or a frozen copy's; group: the
    sequence-parallel Group (app/core/sequence_step.py) whose ranks each run a slice of the sequences, or None;
    fused: the output layer runs tiled with the log-probabilities, as the policy's does (--tiled), never the whole
    logits."""

    def __init__(self, engine, adapters_off: bool, group=None, fused: bool = False):
        self.engine, self.adapters_off, self.group, self.fused = engine, adapters_off, group, fused

    def __call__(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Each sequence's log-probability of its answer (under sequence parallelism: its slices' summed)."""
        if self.group is None:
            return answer_logps(self.logits(ids, None, next_token_targets(labels) if self.fused else None),
                                labels)[:, 0]
        ids, positions, targets = self.group.slice([ids], labels)
        return self.group.whole(target_logps(self.logits(ids, positions, targets if self.fused else None),
                                             targets))[:, 0]

    def share(self) -> tuple:
        """(which share of a set this rank computes, of how many, whether its results count): a share a rank, or
        under sequence parallelism a share a group, counted on the group's first rank."""
        if self.group is None:
            return dist.rank(), dist.world_size(), True
        return self.group.replica, self.group.replicas, self.group.rank == 0

    def logits(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The reference's logits of the sequences (inputs: the ids, then the model's second input and the targets
        that make it return TokenSums in their place, where given)."""
        engine = self.engine
        training = engine.module.training
        off = engine.module.hf.disable_adapter() if self.adapters_off else contextlib.nullcontext()
        engine.eval()
        try:
            with torch.no_grad(), torch.compiler.set_stance("force_eager"), off:
                # the policy's own engine: its forward counts as part of the policy's step (ZeRO-3's gather order)
                return ds_internals.forward_within_the_step(engine, *inputs) if self.adapters_off else \
                    engine(*inputs)
        finally:
            engine.train(training)


class AgainstReference(TextTask):
    """A text task whose loss compares the model with a reference (preference tuning, GRPO's KL term): the model
    with its LoRA adapters off, or a frozen copy built as it is; reference_kind says which (the subclass sets it)."""
    frozen = None

    def live_reference(self, engine, group=None):
        """The Reference a step asks for each micro batch: the adapters off, the frozen copy, or None (none, or one
        the batch brings, or before before_search(): a tool's steps); group: as Reference's."""
        if self.reference_kind == "adapters off":
            return Reference(engine, adapters_off=True, group=group, fused=self.fused_logits)
        return Reference(self.frozen, adapters_off=False, group=group, fused=self.fused_logits) \
            if self.frozen is not None else None

    def before_search(self, ds: dict, replicas: int):
        """The frozen copy, when the run trains against one, so the search's trial steps carry it as the run will."""
        if self.reference_kind == "frozen copy":
            self.frozen = frozen_copy(lambda ref: self.build_model(self.data.info, ref), ds, replicas)

    def after_trial(self):
        """What a trial that ran out of memory left gathered in the frozen copy's partitions."""
        if self.frozen is not None and self.frozen.zero_optimization_partition_weights():
            self.frozen.empty_partition_cache()
