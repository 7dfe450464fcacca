"""Train a model through DeepSpeed: parse, set up, build, fit, tear down."""
import dataclasses
import os
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python app/train.py` or by a launcher: make `app` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from app import checkpoint, config, data, distributed, loop, metrics, models, preemption
from app.errors import UserError


def seed_everything(seed: int):
    """The same seed on every rank: identical initial weights and data order."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def output_dir_for(settings) -> Path:
    """The run's output directory: the flag, or a fresh timestamped one chosen by rank 0."""
    if settings.resume == "auto" and not settings.output_dir:
        raise UserError("--resume auto continues the run in --output_dir; pass the same --output_dir as that run")
    if settings.resume and settings.resume != "auto" and not settings.output_dir:
        settings.output_dir = str(Path(settings.resume).resolve().parent.parent)  # <run>/checkpoints/<tag>
    name = settings.output_dir or f"runs/{settings.dataset}-{settings.model}-{time.strftime('%Y%m%d-%H%M%S')}"
    path = Path(distributed.broadcast_object(name))
    problem = distributed.broadcast_object(metrics.check_output_dir(path, settings.overwrite, bool(settings.resume))
                                           if distributed.is_main() else "")
    if problem:
        raise UserError(problem)
    return path


def plan_resume(settings, output_dir, ds_config, world):
    """The checkpoint to resume from (or None) and the DeepSpeed dict that can load it, checked before any build."""
    folder, saved = checkpoint.find(output_dir, settings.resume)
    if folder is None:
        if settings.resume:
            distributed.print0(f"resume: no complete checkpoint in {checkpoint.checkpoint_root(output_dir)}, "
                               f"starting fresh")
        return None, None, ds_config
    checkpoint.check_compatible(saved, {"model": settings.model, "dataset": settings.dataset,
                                        "zero_stage": config.zero_stage(ds_config)}, folder)
    if checkpoint.needs_universal(saved, world.world_size):
        distributed.print0(f"resume: {folder} was saved by {saved['world_size']} rank(s), this run has "
                           f"{world.world_size}: converting it to a universal checkpoint")
        folder = checkpoint.make_universal(folder)
        ds_config = {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}
    return folder, saved, ds_config


def resume(engine, folder, saved, world) -> tuple:
    """Restore the planned checkpoint (if any) and return the (epoch, batch) to continue from."""
    if folder is None:
        return 0, 0
    samples = checkpoint.load(engine, folder, saved)
    span = engine.train_micro_batch_size_per_gpu() * world.world_size
    if samples % span:
        distributed.print0(f"resume: {samples} samples into the epoch is not a whole number of global micro "
                           f"batches of {span}; repeating the last {samples % span}")
    distributed.print0(f"resume: {folder} at step {saved['step']}, epoch {saved['epoch']}, batch {saved['batch']}")
    return saved["epoch"], samples // span


def main(argv=None) -> int:
    """Run one training job; returns the process exit code."""
    started, stop = time.perf_counter(), None
    distributed.prepare_environment()
    try:
        settings, ds_config = config.parse(argv)
        world = distributed.setup(settings.single_process, settings.dist_timeout)
        ds_config = config.resolve_batch_sizes(ds_config, world.world_size, settings.deepspeed_config)
        output_dir = output_dir_for(settings)
        seed_everything(settings.seed)
        with distributed.main_process_first():
            train_set, eval_set, info = data.build_datasets(settings.dataset, settings.data_dir, settings.image_size)
        model = models.build_model(settings.model, info)
        micro, accum = ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]
        loader_args = dict(rank=world.rank, world_size=world.world_size, seed=settings.seed,
                           num_workers=settings.num_workers, pin_memory=settings.pin_memory)
        train_loader = data.build_loader(train_set, micro, shuffle=True, **loader_args)
        eval_loader = data.build_loader(eval_set, micro, shuffle=False, **loader_args)
        steps = loop.total_steps(settings.max_steps, settings.epochs, len(train_loader), accum)
        folder, saved, ds_config = plan_resume(settings, output_dir, ds_config, world)
        engine = loop.build_engine(model, config.fill_scheduler_length(ds_config, steps))
        distributed.print0(f"mode: {world.reason}; ZeRO stage {engine.zero_optimization_stage()}, "
                           f"global batch {engine.train_batch_size()}, {steps} steps -> {output_dir}")
        record = {"model": settings.model, "dataset": settings.dataset, "world_size": world.world_size,
                  "zero_stage": engine.zero_optimization_stage(), "settings": config.settings_dict(settings),
                  "data_info": dataclasses.asdict(info),
                  "deepspeed_config": ds_config}
        start = resume(engine, folder, saved, world)
        if engine.global_steps >= steps:
            distributed.print0(f"nothing to do: the checkpoint is at step {engine.global_steps} and this run ends at "
                               f"step {steps}; raise --max_steps or --epochs to train further")
            return 0
        stop = preemption.StopRequest(settings.grace_period, world.device, world.launcher != "none")
        log = metrics.RunLog(output_dir, steps, resumed_step=engine.global_steps)
        save = lambda position: checkpoint.save(engine, output_dir, position, record, settings.keep_last)  # noqa: E731
        result = loop.fit(engine, train_loader, eval_loader, settings, log, steps, start, save, stop)
        peak = distributed.all_reduce_max(torch.tensor([metrics.peak_memory_bytes(world.device)]))
        summary = {**result, "world_size": world.world_size, "zero_stage": engine.zero_optimization_stage(),
                   "precision": str(loop.input_dtype(engine)).replace("torch.", ""), "model": settings.model,
                   "dataset": settings.dataset, "deepspeed_config": settings.deepspeed_config,
                   "launcher": world.launcher, "peak_memory_bytes": int(peak.item()),
                   "wall_s": time.perf_counter() - started}
        log.finish(summary)
        if result["stopped_early"]:
            distributed.print0(f"stopped at step {summary['steps']} on request ({stop.reason or 'another rank'}); "
                               f"checkpoint saved; continue with --resume auto --output_dir {output_dir}")
            return 0
        distributed.print0(f"done: eval_loss {summary.get('eval_loss', float('nan')):.4f} eval_accuracy "
                           f"{summary.get('eval_accuracy', float('nan')):.4f} {summary['samples_per_s']:.0f} "
                           f"samples/s in {summary['wall_s']:.1f} s; files in {output_dir}")
        return 0
    except UserError as e:
        report(e)
        return 2
    finally:
        if stop is not None:
            stop.close()
        distributed.teardown()


def report(error: UserError):
    """One line on stderr from rank 0; other ranks speak only if rank 0 did not end the run first."""
    if distributed.rank() != 0:
        time.sleep(3)  # the launcher stops us before this if rank 0 failed the same way
        print(f"[rank {distributed.rank()}] error: {error}", file=sys.stderr, flush=True)
    else:
        print(f"error: {error}", file=sys.stderr, flush=True)


def exit_now(code: int):
    """End the process once main() has closed everything, skipping interpreter finalization.

    Static destructors of the communication libraries have aborted a finished rank here
    ("terminate called without an active exception"), turning a clean exit 0 into -6.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
