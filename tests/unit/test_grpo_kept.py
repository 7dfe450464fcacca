"""What a cycle of --num_iterations GRPO steps keeps of its completions (app/core/grpo_kept.py): kept by row, a
window's groups come back for its batches in their order, and every rank's saved files merge into one, a row that
a rank trained on winning over the same row as another's padding."""
import pytest
import torch

from app.core.grpo_kept import FIELDS, Kept
from app.core.grpo_step import Part

GROUP, LENGTH = 2, 3


def part(rows: list, share: float, seed: int) -> Part:
    """A micro batch's Part of rows (each its group of GROUP completions), every field drawn from seed."""
    g = torch.Generator().manual_seed(seed)
    n = len(rows) * GROUP
    fields = {"completions": torch.randint(0, 9, (n, LENGTH), generator=g), "mask": torch.rand(n, LENGTH, generator=g),
              "truncated": torch.rand(n, generator=g) > 0.5, "length": torch.randint(1, 4, (n,), generator=g),
              "rewards": torch.rand(n, 2, generator=g, dtype=torch.float64), "advantages": torch.randn(n, generator=g),
              "old": torch.randn(n, LENGTH, generator=g)}
    return Part(ids=torch.zeros(n, 5, dtype=torch.long), starts=torch.full((n,), 2), share=torch.full((n,), share),
                rows=[r for r in rows for _ in range(GROUP)], texts=[f"{r}/{j}" for r in rows for j in range(GROUP)],
                **fields)


def batch(rows: list) -> tuple:
    """A loader batch of prompts: (ids, [row, prompt length], weights)."""
    return torch.zeros(len(rows), 2), torch.tensor([[r, 2] for r in rows]), torch.ones(len(rows))


def rebuilt(b, fields: dict, texts: list) -> dict:
    return {"rows": b[1][:, 0].tolist(), "texts": texts, **fields}


def test_a_windows_groups_come_back_for_its_batches_in_their_order():
    parts = [part([4, 7], 0.5, seed=0), part([1, 9], 0.5, seed=1)]
    kept = Kept.of(parts, {"tokens": 12.0, "sampling_s": 3.0, "shown": {"reward": 0.5}}, GROUP)
    assert kept.totals == {"tokens": 12.0, "shown": {"reward": 0.5}}, "the sampling time is the first step's own"
    again = kept.parts([batch([4, 7]), batch([1, 9])], GROUP, rebuilt)
    for found, original in zip(again, parts):
        assert found["texts"] == original.texts
        assert all(torch.equal(found[name], getattr(original, name)) for name in FIELDS)
    other = kept.parts([batch([9, 4])], GROUP, rebuilt)[0]  # another world size groups the rows otherwise
    assert other["texts"] == ["9/0", "9/1", "4/0", "4/1"]
    assert torch.equal(other["old"], torch.cat([parts[1].old[2:], parts[0].old[:2]]))


def test_a_row_the_cycle_did_not_sample_is_an_error():
    kept = Kept.of([part([4, 7], 0.5, seed=0)], {"tokens": 1.0}, GROUP)
    with pytest.raises(RuntimeError, match=r"rows \[5\]"):
        kept.parts([batch([4, 5])], GROUP, rebuilt)


def test_every_ranks_file_merges_and_a_trained_row_wins_over_padding(tmp_path):
    """Rank 1 padded its batch with row 4 (weight 0) and sampled it at its own numerics; rank 0 trained on it."""
    trained = part([4, 7], 0.5, seed=0)
    padding = part([2, 4], 0.5, seed=1)
    padding.share[GROUP:] = 0.0
    totals = {"tokens": 9.0, "batch_std": float("nan")}
    Kept.of([padding], totals, GROUP).save(tmp_path / "grpo_kept_rank00001.pt")
    Kept.of([trained], totals, GROUP).save(tmp_path / "grpo_kept_rank00000.pt")
    for order in (sorted, lambda paths: sorted(paths, reverse=True)):
        merged = Kept.load(order(tmp_path.glob("*.pt")))
        assert sorted(merged.rows) == [2, 4, 7] and merged.totals["tokens"] == 9.0
        found = merged.parts([batch([4, 2])], GROUP, rebuilt)[0]
        assert torch.equal(found["old"][:GROUP], trained.old[:GROUP]), "row 4 as rank 0 trained on it"
        assert torch.equal(found["old"][GROUP:], padding.old[:GROUP])
