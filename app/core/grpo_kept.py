"""The completions a cycle of GRPO steps trains on (--num_iterations mu > 1, TRL's mu): sampled at the cycle's first
step, kept by row with the old policy's log-probabilities, and trained on again at each of its next mu - 1 steps,
whose windows the loader gives again (app/data/loader.py: repeats). Every rank saves what it keeps in each
checkpoint; a resume reads every rank's file, so a run stopped inside a cycle ends it on any world size."""
from dataclasses import dataclass
from pathlib import Path

import torch

FIELDS = ("completions", "mask", "truncated", "length", "rewards", "advantages", "old")
"""What a row's group keeps of its Part (app/core/grpo_step.py), a tensor each, its first dimension the group."""


@dataclass
class Kept:
    """rows: {row: (its group's FIELDS, their texts, whether a rank trained on it (not padding))}; totals: the
    window's totals over every rank (the same on each)."""
    rows: dict
    totals: dict

    @classmethod
    def of(cls, parts: list, totals: dict, group: int) -> "Kept":
        """What a rank keeps of its window's Parts (padding rows too: a repeated window pads alike; a row it also
        trains on keeps that group)."""
        rows = {}
        for part in parts:
            for g in range(0, len(part.rows), group):
                picked, real = slice(g, g + group), bool(part.share[g] > 0)
                if part.rows[g] not in rows or real and not rows[part.rows[g]][2]:
                    fields = {name: getattr(part, name)[picked].clone() for name in FIELDS}
                    rows[part.rows[g]] = (fields, part.texts[picked], real)
        return cls(rows, {k: v for k, v in totals.items() if k != "sampling_s"})

    def parts(self, window: list, group: int, template) -> list:
        """The window's Parts again, for its batches (prompts, [rows, prompt lengths], loader weights), built like
        `template(batch, fields, texts)` from each row's kept group."""
        made = []
        for batch in window:
            rows = batch[1][:, 0].tolist()
            missing = [r for r in rows if r not in self.rows]
            if missing:
                raise RuntimeError(f"rows {missing} of a repeated window were not sampled in its cycle")
            fields = {name: torch.cat([self.rows[r][0][name] for r in rows]) for name in FIELDS}
            texts = [t for r in rows for t in self.rows[r][1]]
            made.append(template(batch, fields, texts))
        return made

    def save(self, path: Path):
        torch.save({"rows": self.rows, "totals": self.totals}, path)

    @classmethod
    def load(cls, paths: list) -> "Kept":
        """Every rank's file merged: a row trained on somewhere wins over the same row as another rank's padding."""
        rows, totals = {}, {}
        for path in paths:
            saved = torch.load(path, weights_only=True)  # tensors, numbers and text: nothing runs from a checkpoint
            totals = totals or saved["totals"]
            for row, kept in saved["rows"].items():
                if row not in rows or kept[2] and not rows[row][2]:
                    rows[row] = kept
        return cls(rows, totals)

