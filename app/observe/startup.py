"""The start-up lines of a run: how it is laid out, the precision picked, and a note on DeepSpeed's version."""
from pathlib import Path

from app.distributed import dist
from app.ds import internals as ds_internals
from app.ds import precision


def say_mode(description: str, engine, steps: int, output_dir: Path, replicas: int, layout_lines: list, note: str,
             tf32: str):
    """description: the world's; layout_lines: the model parallelism's and LoRA's lines ('' for none); note: why
    "auto" picked the precision; tf32: what fp32 matmuls run in."""
    shown = precision.precision_name(engine)
    shown = note if note.startswith(shown + " (") else shown
    batch = replicas * engine.train_micro_batch_size_per_gpu() * engine.gradient_accumulation_steps()
    dist.print0(f"mode: {description}; ZeRO stage {engine.zero_optimization_stage()}, "
                f"global batch {batch}, {steps} steps -> {output_dir}")
    for line in layout_lines:
        if line:
            dist.print0(line)
    dist.print0(f"precision: {shown}{'; ' + tf32 if tf32 else ''}")
    warning = ds_internals.version_note()
    if warning:
        dist.print0(warning)
