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


def add_planned_peaks(rows: list, configs: dict, work) -> list:
    """Set plan_peak_bytes, plan_over_peak and plan_host_bytes (what the rank offloads to the host) on each app row
    the plan covers (a LoRA mode planned with the adapters the benchmark gave it); the lines that say them. On a CPU
    the measured peak is the process's resident set, which the plan does not predict."""
    task = copy.copy(work.task)
    task.data = Data(work.train_set, None, work.info)  # the plan's model is the benchmark's: its classes and images
    builds = {}
    plans, lines = {}, []
    for row in rows:
        row["plan_peak_bytes"] = row["plan_over_peak"] = row["plan_host_bytes"] = None
        name, lora_mode = row["mode"].split("+")[0], row["mode"].endswith(LORA)
        if row["mode"] in TORCH_MODES or name not in configs or (lora_mode and not work.task.spec):
            continue
        key = (name, row["ranks"], lora_mode, bool(row.get("compiled")))
        if key not in plans:
            if lora_mode not in builds:  # LoRA: the base frozen, the backward through it to the input
                builds[lora_mode] = planner.workload(task, work.info.seq_len, work.info.image_size, frozen=lora_mode)
            facts = resolver.auto_facts(work.task.spec, "cuda" if torch.cuda.is_available() else "cpu")
            ds = ds_auto.fill(configs[name], facts, row["ranks"])[0]  # as the mode ran it
            settings = work.task.settings  # the adapters build_model gives a LoRA mode: the task's own
            adapters = (settings.lora_rank, lora.targets_of(settings)) if lora_mode else None
            plans[key] = planner.plans(builds[lora_mode], {name: ds}, row["ranks"], adapters,
                                       compiles=lambda _: key[3])[name]  # as the mode ran: compiled or eager
        planned, measured = plans[key].peak(row["micro_batch"]), max(row["peak_memory_bytes"])
        row["plan_peak_bytes"], row["plan_over_peak"] = planned, planned / measured if measured else None
        row["plan_host_bytes"] = offloaded = host.offloaded(plans[key])
        lines.append(f"plan {row['mode']} x{row['ranks']}: {planned / 2**20:.0f} MB planned, {measured / 2**20:.0f} "
                     f"MB measured, plan/peak {row['plan_over_peak']:.3f}" if measured else "")
        if offloaded and row.get("host_peak_bytes"):  # beside the whole process's: the offloaded states are part
            lines.append(f"plan host {row['mode']} x{row['ranks']}: {offloaded / 2**20:.0f} MB offloaded planned, "
                         f"host peak {max(row['host_peak_bytes']) / 2**20:.0f} MB measured")
    return [line for line in lines if line]
