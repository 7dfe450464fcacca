"""The run's summary: summary.json and the plot (app/observe/runlog.py), and the last line saying how it ended."""
import time

import torch

from app.distributed import dist
from app.ds import precision
from app.observe import metrics

RATES = ("samples_per_s", "tokens_per_s", "mfu")


def summarise(result: dict, settings, world, engine, task, log, stop, started: float) -> int:
    """Write summary.json and the plot, say how the run ended (result: the loop's totals; task: its name, rates
    per sample and the metrics its last line shows); the exit code."""
    peak, host_peak = dist.host_max([metrics.peak_memory_bytes(world.device),
                                     metrics.peak_memory_bytes(torch.device("cpu"))])
    summary = {**result, "world_size": world.world_size, "zero_stage": engine.zero_optimization_stage(),
               "pipeline_stages": engine.num_stages if engine.pipeline_parallelism else 0,
               "tensor_parallel_size": engine.autotp_size(),
               "precision": str(precision.compute_dtype(engine)).replace("torch.", ""),
               "autocast": engine.torch_autocast_enabled(), "model": settings.model,
               "dataset": settings.dataset, "task": task.name, "deepspeed_config_file": settings.deepspeed_config,
               "launcher": world.launcher, "peak_memory_bytes": int(peak),
               "host_peak_bytes": int(host_peak),
               "wall_s": time.perf_counter() - started}
    per_sample = task.per_sample()  # instruction data: rows and real tokens in each (padded or packed) sample
    summary.update({f"{what}_per_s": summary["samples_per_s"] * n for what, n in per_sample.items()})
    log.finish(summary)
    if result["stopped_early"]:
        dist.print0(f"stopped at step {summary['steps']} on request ({stop.reason or 'another rank'}); "
                    f"checkpoint saved; continue with --resume auto --output_dir {log.output_dir}")
        return 0
    early = result.get("early_stopping", {})
    why = f"stopped early at step {summary['steps']}, {early['why']}; " if early.get("stopped") else ""
    dist.print0(f"{why or 'done: '}{shown(summary, task.summary_metrics)} in {summary['wall_s']:.1f} s; files in "
                f"{log.output_dir}")
    return 0


def shown(summary: dict, names: tuple) -> str:
    """The task's metrics and the rates, as the last line shows them (those the summary has)."""
    return " ".join(f"{k} {summary[k]:.4g}" for k in (*names, *RATES) if k in summary)
