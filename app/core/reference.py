"""The reference model of preference tuning when it is not the policy with its adapters off: a frozen copy built as
the policy is, and the reference's log-probabilities computed once (--reference precompute) and kept beside the
tokenized data, keyed by the data, the base model and the precision, so a resumed run, or one on another world
size, reads them instead."""
import hashlib
import json
from pathlib import Path

import torch

from app.checkpoint.save import atomic_write
from app.distributed import dist
from app.ds import run_dict

FILE = "reference-logps-{}.json"


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
    """[[chosen, rejected]] log-probabilities of every pair: each rank computes every world-th pair, micro pairs at
    a time, all ranks the same number of forwards (ZeRO-3 gathers in each), then they are summed across ranks."""
    rank, world = dist.rank(), dist.world_size()
    mine = list(range(rank, len(pairs), world))
    padded = mine + [mine[0] if mine else 0] * (-(-len(pairs) // world) - len(mine))  # repeats, not kept
    table = torch.zeros(len(pairs), 2, dtype=torch.float64)
    device = reference.engine.device
    for start in range(0, len(padded), micro):
        items = [pairs[i] for i in padded[start:start + micro]]
        ids = torch.stack([x for x, _ in items]).to(device).flatten(0, 1)
        labels = torch.stack([y[0] for _, y in items]).to(device).flatten(0, 1)
        logps = reference(ids, labels).view(-1, 2).double().cpu()
        kept = mine[start:start + micro]
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
