"""Train a model through DeepSpeed: parse, set up, build, fit, tear down."""
import gc
import os
import random
from dataclasses import asdict
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python app/train.py` or by a launcher: make `app` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from app.memory import autobatch, fit
from app.core import answers as sample_answers
from app.core import compiling
from app.core import packing
from app.distributed import dist, endings
from app.ds import auto as ds_auto
from app.ds import config as ds_config
from app.ds import internals as ds_internals
from app.distributed import launch
from app.core import loop
from app.core import lora
from app.observe import metrics
from app.core import models
from app.distributed import node_shell
from app.checkpoint import outdir
from app.parallel import layout
from app.ds import precision
from app.ds import run_dict
from app.distributed import preemption
from app.checkpoint import resume
from app.observe import runlog
from app.core import tasks
from app.checkpoint.save import TrainerState, checkpoint_root, complete_checkpoints, save_checkpoint
from app.settings import Settings, parse, settings_dict
from app.data.loader import build_loader, feeding
from app.distributed.cores import usable_cores
from app.distributed.dist import World
from app.errors import Ended, UserError, report


def seed_everything(seed: int):
    """The same seed on every rank: identical initial weights and data order."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def output_dir_for(settings: Settings) -> Path:
    """The run's output directory (the flag, the resumed checkpoint's own run folder, or a fresh timestamped one
    chosen by rank 0), checked and locked for this run by rank 0."""
    if settings.resume == "auto" and not settings.output_dir:
        raise UserError("--resume auto continues the run in --output_dir; pass the same --output_dir as that run")
    if settings.resume and settings.resume != "auto" and not settings.output_dir:
        settings.output_dir = str(resume.run_folder_of(settings.resume))
    path = Path(dist.broadcast_object(settings.output_dir or outdir.default_name(settings.dataset, settings.model)))
    problem, note = "", ""
    if dist.is_main():
        problem = outdir.check(path, settings.overwrite, bool(settings.resume))
        problem, note = (problem, "") if problem else outdir.lock(path)
    problem = dist.broadcast_object(problem)
    if problem:
        raise UserError(problem)
    if note:
        dist.print0(note)
    return path


def throughput_for(task, flops: float, engine, settings: Settings) -> metrics.Throughput:
    """Tokens/s and model FLOP utilisation where the task has tokens; the peak is --peak_flops or a matmul
    measured now."""
    if not task.tokens_per_sample:
        return metrics.Throughput()
    dist.barrier()  # every rank measures at once, as they will share the machine while training
    per_rank = settings.peak_flops or \
        dist.host_sum([metrics.matmul_flops(engine.device, precision.compute_dtype(engine))])[0] / dist.world_size()
    dist.print0(f"throughput: {flops / task.tokens_per_sample / 1e6:.1f} MFLOP per token trained, peak "
                f"{per_rank / 1e9:.1f} GFLOP/s per rank ({'--peak_flops' if settings.peak_flops else 'measured'})")
    return metrics.Throughput(task.tokens_per_sample, flops, per_rank * dist.world_size())


def main(argv=None) -> int:
    """Run one training job; returns the process exit code."""
    started = time.perf_counter()
    gc.freeze()  # the imports' objects live as long as the process: full collections skip them
    launch.prepare_environment()
    try:
        try:
            settings, ds = parse(argv)
            node_shell.check_launch_hosts()
        except UserError as e:
            launch.said_before_start(e)  # another rank than 0 tells rank 0, which says it
            raise
        world = launch.setup(settings.single_process, settings.dist_timeout)
        node_shell.check_launch_line(sys.argv[1:] if argv is None else argv)
        return run(settings, ds, world, started)
    except (UserError, Ended) as e:
        return report(e)
    finally:
        dist.teardown()


def run(settings: Settings, ds: dict, world: World, started: float) -> int:  # long: the job's steps in order
    """One training job inside an existing process group: build, resume, fit, summarise; an error that ends it is
    one line (app/distributed/endings.py)."""
    board, built = endings.Board(), {}
    with endings.one_line(board, lambda: built.get("engine")):
        return _run(settings, ds, world, started, board, built)


def _run(settings, ds, world, started, board, built: dict) -> int:  # long: the job's steps in order
    stop = None
    try:
        ranks = layout.rank_layout(ds, world.world_size, world.rank, settings.deepspeed_config)
        task = tasks.build(settings)
        lora.check_layout(settings.lora, ranks)
        ds, filled, precision_note = planned_dict(ds, settings, world, ranks, task)
        output_dir = output_dir_for(settings)
        seed_everything(settings.seed)
        train_set, eval_set, info = task.build_data(output_dir)
        if info.packed and ranks.split:
            raise UserError("packing and pipeline stages: a stage takes input ids alone, not the position ids that "
                            "keep packed rows apart; pass --packing off")
        ds = autobatch.settle(ds, settings.deepspeed_config, ranks, task, lambda trial: ranks.prepare(
            task.build_model(info, trial), task, settings.model, trial)[0], train_set, output_dir, settings.resume,
                              board)
        model = task.build_model(info, ds)
        flops = task.flops_per_sample(model, info) if task.tokens_per_sample else 0.0  # before AutoTP shards it
        learnt = run_dict.trainable(model)  # the whole model's, the same on every rank
        trained, save_files, every_rank = ranks.prepare(model, task, settings.model, ds)
        del model  # a pipeline stage keeps only its own layers
        train_loader, eval_loader = loaders(train_set, eval_set, ds, settings, world, ranks)
        steps = loop.total_steps(settings.max_steps, settings.epochs, len(train_loader),
                                 ds["gradient_accumulation_steps"])
        state = trainer_state(settings, world, ranks, info, ds, task)
        folder, saved, universal = resume.plan_resume(output_dir, settings.resume, state, settings.overwrite)
        ds = state.deepspeed_config = run_dict.final(ds, filled, steps, universal, learnt, ranks.tensor)
        engine = built["engine"] = loop.build_engine(trained, ds)  # exactly the dict the checkpoints record
        tf32 = precision.set_tf32(world.device, precision.compute_dtype(engine), settings.tf32)
        say_mode(settings, world, engine, steps, output_dir, ranks, precision_note, tf32)
        if info.packed:
            packing.check(engine, task, train_set)
        if filled:
            dist.print0(ds_auto.say(ds, filled, output_dir, dist.is_main()))
        log_throughput = throughput_for(task, flops, engine, settings)
        start = resume.load(engine, folder, saved, ranks.replicas) if folder else (0, 0)
        if nothing_to_do(engine, steps):
            return 0
        outdir.clear(output_dir, folder, settings.overwrite)  # only now: a mistake found before leaves it all
        stop = preemption.StopRequest(board, settings.grace_period, world.launcher != "none")
        log = runlog.RunLog(output_dir, steps, engine.global_steps, throughput=log_throughput)
        metrics.reset_peak_memory(world.device)  # the summary's peak is the training's, not the start-up probe's
        save = lambda *at: save_checkpoint(engine, output_dir, state.at(*at), settings.keep_last,  # noqa: E731
                                           save_files, every_rank)
        step = ranks.train_step(engine, task, compiling.wanted(settings.compile, engine.device), board)
        schedule = loop.Schedule(steps, settings.log_interval, settings.eval_interval, settings.save_interval,
                                 settings.max_nonfinite_steps)
        with log.discarded_on_error(lambda: complete_checkpoints(checkpoint_root(output_dir))):
            answers = sample_answers.for_run(engine, task, output_dir, settings.eval_answers, settings.answer_tokens)
            result = loop.Loop(step, train_loader, eval_loader, schedule, log, save, stop, answers).fit(start)
        return summarise(result, settings, world, engine, task, log, stop, started)
    finally:
        if stop is not None:
            stop.close()
        outdir.unlock()
        ds_internals.forget_parallel_groups()  # another job may follow in this process (the tests pool them)


def trainer_state(settings: Settings, world: World, ranks, info, ds: dict, task) -> TrainerState:
    """What this run's checkpoints record besides DeepSpeed's shards, at step 0."""
    return TrainerState(step=0, epoch=0, batch=0, model=settings.model, dataset=settings.dataset,
                        world_size=world.world_size, zero_stage=ds_config.zero_stage(ds),
                        settings=settings_dict(settings), data_info=asdict(info), deepspeed_config=ds,
                        pipeline_stages=ranks.split.stages if ranks.split else 0,
                        data_parallel_size=ranks.replicas, tensor_parallel_size=ranks.tensor,
                        lora=lora.record(settings, getattr(task, "spec", None)))


def planned_dict(ds: dict, settings: Settings, world: World, ranks, task) -> tuple:
    """(DeepSpeed dict, what "auto" filled, why precision was picked) as planned before the data
    (app/ds/run_dict.py), on a GPU weighed against its memory; run_dict.final makes the run's dict of it."""
    ds, filled, note = run_dict.planned(ds, settings.deepspeed_config, world.device, ranks.replicas, auto_facts(task))
    gpu = torch.cuda.get_device_properties(world.device).total_memory if world.device.type == "cuda" else 0
    if not (ranks.split or ranks.tensor > 1):  # the plan is data parallel's: a split model's bytes are its stages'
        ds, note = dist.broadcast_object(fit.weigh(ds, note, task, settings, ranks.replicas, gpu)
                                         if dist.is_main() else None)  # one decision, however the GPUs differ
    return ds, filled, note


def auto_facts(task) -> ds_auto.Facts:
    """What "auto" values depend on besides the JSON: whether the model loads trained weights, its hidden size."""
    spec = getattr(task, "spec", None)
    if spec is None:
        return ds_auto.Facts()
    config = spec.config
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or getattr(config, "d_model", 0)
    folder = Path(spec.pretrained) if spec.pretrained else None
    weights = bool(spec.pretrained) and not (folder.is_dir() and not any(
        any(folder.glob(pattern)) for pattern in models.WEIGHT_FILES))
    return ds_auto.Facts(pretrained=weights, hidden=int(hidden or 0))


def nothing_to_do(engine, steps: int) -> bool:
    """True (and says so) when the checkpoint resumed from is already at or past the run's last step."""
    if engine.global_steps < steps:
        return False
    dist.print0(f"nothing to do: the checkpoint is at step {engine.global_steps} and this run ends at "
                f"step {steps}; raise --max_steps or --epochs to train further")
    return True


def loaders(train_set, eval_set, ds: dict, settings: Settings, world: World, ranks: layout.RankLayout) -> tuple:
    """(train loader, eval loader) over this data-parallel replica's shard (the stages of a pipeline share one)."""
    workers, pin = feeding(train_set, world.device.type == "cuda", usable_cores() // world.local_world_size,
                           settings.num_workers, settings.pin_memory)
    if workers or pin:
        dist.print0(f"data: {workers} loader worker(s) per rank, {'pinned' if pin else 'pageable'} host memory")
    args = dict(rank=ranks.replica, world_size=ranks.replicas, seed=settings.seed, num_workers=workers,
                pin_memory=pin)
    micro = ds["train_micro_batch_size_per_gpu"]
    return (build_loader(train_set, micro, shuffle=True, accumulation=ds["gradient_accumulation_steps"], **args),
            build_loader(eval_set, micro, shuffle=False, persistent=False, normalise=False, **args))


def say_mode(settings: Settings, world: World, engine, steps: int, output_dir: Path, ranks: layout.RankLayout,
             note: str, tf32: str):
    """The start-up lines: how the run is laid out, and the precision picked (note: why "auto" picked it; tf32:
    what fp32 matmuls run in)."""
    shown = precision.precision_name(engine)
    shown = note if note.startswith(shown + " (") else shown
    batch = ranks.replicas * engine.train_micro_batch_size_per_gpu() * engine.gradient_accumulation_steps()
    dist.print0(f"mode: {world.description}; ZeRO stage {engine.zero_optimization_stage()}, "
                f"global batch {batch}, {steps} steps -> {output_dir}")
    parallelism = ranks.describe(engine)
    if parallelism:
        dist.print0(parallelism)
    if settings.lora:
        dist.print0(lora.describe(engine.module))
    dist.print0(f"precision: {shown}{'; ' + tf32 if tf32 else ''}")
    warning = ds_internals.version_note()
    if warning:
        dist.print0(warning)


def summarise(result: dict, settings: Settings, world: World, engine, task, log, stop, started: float) -> int:
    """Write summary.json and the plot, say how the run ended; the exit code."""
    peak = dist.host_max([metrics.peak_memory_bytes(world.device)])[0]
    summary = {**result, "world_size": world.world_size, "zero_stage": engine.zero_optimization_stage(),
               "pipeline_stages": engine.num_stages if engine.pipeline_parallelism else 0,
               "tensor_parallel_size": engine.autotp_size(),
               "precision": str(precision.compute_dtype(engine)).replace("torch.", ""),
               "autocast": engine.torch_autocast_enabled(), "model": settings.model,
               "dataset": settings.dataset, "task": task.name, "deepspeed_config": settings.deepspeed_config,
               "launcher": world.launcher, "peak_memory_bytes": int(peak),
               "wall_s": time.perf_counter() - started}
    per_sample = task.per_sample()  # instruction data: rows and real tokens in each (padded or packed) sample
    summary.update({f"{what}_per_s": summary["samples_per_s"] * n for what, n in per_sample.items()})
    log.finish(summary)
    if result["stopped_early"]:
        dist.print0(f"stopped at step {summary['steps']} on request ({stop.reason or 'another rank'}); "
                    f"checkpoint saved; continue with --resume auto --output_dir {log.output_dir}")
        return 0
    shown = " ".join(f"{k} {summary[k]:.4g}" for k in ("eval_loss", "eval_accuracy", "eval_perplexity",
                                                        "samples_per_s", "tokens_per_s", "mfu") if k in summary)
    dist.print0(f"done: {shown} in {summary['wall_s']:.1f} s; files in {log.output_dir}")
    return 0


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
