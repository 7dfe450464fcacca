"""The start-up lines (app/observe/startup.py): the layout, the global batch, the precision and why."""
from types import SimpleNamespace

import torch

from app.observe import startup


def _engine(micro: int, accumulation: int):
    return SimpleNamespace(train_micro_batch_size_per_gpu=lambda: micro, gradient_accumulation_steps=lambda: accumulation,
                           zero_optimization_stage=lambda: 3, bfloat16_enabled=lambda: False,
                           fp16_enabled=lambda: False, torch_autocast_enabled=lambda: True,
                           torch_autocast_dtype=lambda: torch.bfloat16)


def test_the_start_up_lines_say_the_global_batch_and_why_the_precision_was_picked(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("RANK", raising=False)
    note = "bf16 autocast (the GPU supports bf16)"
    startup.say_mode("2 processes on CPU", _engine(4, 2), 10, tmp_path, 2, ["", "LoRA: 2 adapters"], note, "")
    said = capsys.readouterr().out.splitlines()
    assert said[0] == f"mode: 2 processes on CPU; ZeRO stage 3, global batch 16, 10 steps -> {tmp_path}"
    assert said[1] == "LoRA: 2 adapters", "an empty line (no model parallelism) is not said"
    assert said[2].startswith("precision: bf16 autocast")
