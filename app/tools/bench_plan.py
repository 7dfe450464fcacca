"""The memory plan beside the benchmark: for each app mode, the peak the plan predicts for its config, world size and
micro batch, against the peak the device reached in that mode (CUDA's max_memory_allocated on a GPU)."""
import copy

import torch

from app.core import lora, resolver
from app.data import Data
from app.ds import auto as ds_auto
from app.memory import host, planner
from app.tools.bench_modes import LORA
from app.tools.bench_report import TORCH_MODES


def add_planned_peaks(rows: list, configs: dict, work, device: str = "") -> list:
    """Set plan_peak_bytes, plan_over_peak and plan_host_bytes (what the rank offloads to the host) on each app row
    the plan covers (a LoRA mode planned with the adapters the benchmark gave it, compiled or eager as the mode
    ran, the configs' "auto" filled for the device the rows ran on: "cuda" or "cpu", default this machine's);
    the lines that say them. On a CPU the measured peak is the process's resident set, which the plan does not
    predict."""
    planned_rows = [row for row in rows if _planned(row, configs, work)]
    for row in rows:
        row["plan_peak_bytes"] = row["plan_over_peak"] = row["plan_host_bytes"] = None
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    plans, lines = _plans(planned_rows, configs, work, device), []
    for row in planned_rows:
        plan = plans[_group(row)][row["mode"].split("+")[0]]
        planned, measured = plan.peak(row["micro_batch"]), max(row["peak_memory_bytes"])
        row["plan_peak_bytes"], row["plan_over_peak"] = planned, planned / measured if measured else None
        row["plan_host_bytes"] = offloaded = host.offloaded(plan)
        lines.append(f"plan {row['mode']} x{row['ranks']}: {planned / 2**20:.0f} MB planned, {measured / 2**20:.0f} "
                     f"MB measured, plan/peak {row['plan_over_peak']:.3f}" if measured else "")
        if offloaded and row.get("host_peak_bytes"):  # beside the whole process's: the offloaded states are part
            lines.append(f"plan host {row['mode']} x{row['ranks']}: {offloaded / 2**20:.0f} MB offloaded planned, "
                         f"host peak {max(row['host_peak_bytes']) / 2**20:.0f} MB measured")
    return [line for line in lines if line]


def _planned(row: dict, configs: dict, work) -> bool:
    """Whether the plan covers the row: an app mode of a shipped config (LoRA on a transformers model only)."""
    lora_mode = row["mode"].endswith(LORA)
    return row["mode"] not in TORCH_MODES and row["mode"].split("+")[0] in configs and not (
        lora_mode and not work.task.spec)


def _group(row: dict) -> tuple:
    """The rows one plan measures for: (ranks, LoRA, compiled)."""
    return row["ranks"], row["mode"].endswith(LORA), bool(row.get("compiled"))


def _plans(rows: list, configs: dict, work, device: str) -> dict:
    """{group: {config: MemoryPlan}}: each group's configs planned together, its activations measured once."""
    task = copy.copy(work.task)
    task.data = Data(work.train_set, None, work.info)  # the plan's model is the benchmark's: its classes and images
    facts = resolver.auto_facts(work.task.spec, device)
    settings, found = work.task.settings, {}  # the adapters build_model gives a LoRA mode: the task's own
    groups = dict.fromkeys(_group(row) for row in rows)
    workloads = {lora_mode: planner.workload(task, work.info.seq_len, work.info.image_size, frozen=lora_mode)
                 for lora_mode in {lora_mode for _, lora_mode, _ in groups}}  # LoRA: the model frozen
    for ranks, lora_mode, compiled in groups:
        names = dict.fromkeys(row["mode"].split("+")[0] for row in rows if _group(row) == (ranks, lora_mode,
                                                                                            compiled))
        named = {name: ds_auto.fill(configs[name], facts, ranks)[0] for name in names}  # as the modes ran them
        adapters = (settings.lora_rank, lora.targets_of(settings)) if lora_mode else None
        found[ranks, lora_mode, compiled] = planner.plans(workloads[lora_mode], named, ranks, adapters,
                                                          compiles=lambda _, on=compiled: on)
    return found
