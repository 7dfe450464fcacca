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

from app import checkpoint, compiler, config, data, distributed, loop, metrics, models, preemption, text
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


def build_data(settings, spec, task: str, output_dir: Path):
    """(train set, held-out set, DataInfo, tokenizer or None): images, or text for a transformers model."""
    if spec is not None:
        if settings.dataset in data.BUILDERS:
            raise UserError(f"{settings.model} is a transformers model and trains on text, not {settings.dataset}; "
                            f"pass --dataset <.txt/.json/.jsonl/.csv/.parquet file or folder, or a hub dataset>")
        return text.build_datasets(settings, spec, task, output_dir)
    with distributed.main_process_first():
        return (*data.build_datasets(settings.dataset, settings.data_dir, settings.image_size), None)


def throughput_for(model, info, engine, settings) -> metrics.Throughput:
    """Tokens/s and model FLOP utilisation for text models; the peak is --peak_flops or a matmul measured now."""
    if not info.seq_len:
        return metrics.Throughput()
    distributed.barrier()  # every rank measures at once, as they will share the machine while training
    per_rank = settings.peak_flops or distributed.all_reduce_sum(torch.tensor(
        [metrics.matmul_flops(engine.device, loop.input_dtype(engine))], dtype=torch.float64)).item() / \
        distributed.world_size()
    flops = models.train_flops_per_token(model, info.seq_len) * info.seq_len
    distributed.print0(f"throughput: {flops / info.seq_len / 1e6:.1f} MFLOP per token trained, peak "
                       f"{per_rank / 1e9:.1f} GFLOP/s per rank ({'--peak_flops' if settings.peak_flops else 'measured'})")
    return metrics.Throughput(info.seq_len, flops, per_rank * distributed.world_size())


def main(argv=None) -> int:
    """Run one training job; returns the process exit code."""
    started = time.perf_counter()
    distributed.prepare_environment()
    try:
        settings, ds_config = config.parse(argv)
        world = distributed.setup(settings.single_process, settings.dist_timeout)
        return run(settings, ds_config, world, started)
    except UserError as e:
        report(e)
        return 2
    finally:
        distributed.teardown()


def run(settings, ds_config: dict, world, started: float) -> int:
    """One training job inside an existing process group: build, resume, fit, summarise."""
    stop = None
    try:
        ds_config = config.resolve_batch_sizes(ds_config, world.world_size, settings.deepspeed_config)
        output_dir = output_dir_for(settings)
        seed_everything(settings.seed)
        spec = models.hf_spec(settings.model)
        task = models.resolve_task(spec, settings.task)
        train_set, eval_set, info, tokenizer = build_data(settings, spec, task, output_dir)
        model = models.build_model(settings.model, info, spec, tokenizer, ds_config)
        micro, accum = ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]
        loader_args = dict(rank=world.rank, world_size=world.world_size, seed=settings.seed,
                           num_workers=settings.num_workers, pin_memory=settings.pin_memory)
        train_loader = data.build_loader(train_set, micro, shuffle=True, **loader_args)
        eval_loader = data.build_loader(eval_set, micro, shuffle=False, **loader_args)
        steps = loop.total_steps(settings.max_steps, settings.epochs, len(train_loader), accum)
        folder, saved, ds_config = plan_resume(settings, output_dir, ds_config, world)
        engine = loop.build_engine(model, config.fill_scheduler_length(ds_config, steps))
        precision = config.precision_note(settings.deepspeed_config) or str(loop.input_dtype(engine))[6:]
        tf32 = compiler.set_tf32(world.device, loop.input_dtype(engine), settings.tf32)
        distributed.print0(f"mode: {world.reason}; ZeRO stage {engine.zero_optimization_stage()}, "
                           f"global batch {engine.train_batch_size()}, {steps} steps -> {output_dir}")
        distributed.print0(f"precision: {precision}{'; ' + tf32 if tf32 else ''}")
        throughput = throughput_for(model, info, engine, settings)
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
        extra = (lambda folder: models.save_hf_files(model, tokenizer, folder / checkpoint.HF_FILES)) \
            if spec is not None else None
        save = lambda position: checkpoint.save(engine, output_dir, position, record, settings.keep_last,  # noqa
                                                extra)
        result = loop.fit(engine, train_loader, eval_loader, settings, log, steps, start, save, stop, throughput)
        peak = distributed.all_reduce_max(torch.tensor([metrics.peak_memory_bytes(world.device)]))
        summary = {**result, "world_size": world.world_size, "zero_stage": engine.zero_optimization_stage(),
                   "precision": str(loop.input_dtype(engine)).replace("torch.", ""), "model": settings.model,
                   "dataset": settings.dataset, "task": task, "deepspeed_config": settings.deepspeed_config,
                   "launcher": world.launcher, "peak_memory_bytes": int(peak.item()),
                   "wall_s": time.perf_counter() - started}
        log.finish(summary)
        if result["stopped_early"]:
            distributed.print0(f"stopped at step {summary['steps']} on request ({stop.reason or 'another rank'}); "
                               f"checkpoint saved; continue with --resume auto --output_dir {output_dir}")
            return 0
        shown = " ".join(f"{k} {summary[k]:.4g}" for k in ("eval_loss", "eval_accuracy", "eval_perplexity",
                                                            "samples_per_s", "tokens_per_s", "mfu") if k in summary)
        distributed.print0(f"done: {shown} in {summary['wall_s']:.1f} s; files in {output_dir}")
        return 0
    finally:
        if stop is not None:
            stop.close()


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
