"""Train a model through DeepSpeed: parse, set up, build, fit, tear down."""
import gc
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as `python app/train.py` or by a launcher: make `app` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from app.checkpoint import outdir, resume
from app.checkpoint.save import TrainerState, checkpoint_root, complete_checkpoints, save_checkpoint
from app.core import answers as sample_answers
from app.core import compiling, loop, lora, packing, tasks
from app.data.loader import feeding, held_out_loaders, training_loader
from app.distributed import dist, endings, launch, node_shell, preemption
from app.distributed.cores import usable_cores
from app.distributed.dist import World
from app.ds import auto as ds_auto
from app.ds import config as ds_config
from app.ds import internals as ds_internals
from app.ds import precision, run_dict
from app.errors import Ended, UserError, report
from app.memory import autobatch
from app.memory.fit import weigh
from app.observe import metrics, runlog
from app.parallel import layout
from app.settings import Settings, parse, settings_dict


def seed_everything(seed: int):
    """The same seed on every rank: identical initial weights and data order."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


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


@dataclass
class Job:
    """One training run's state, from its settings to its engine: what run() builds, step by step."""
    settings: Settings
    world: World
    board: endings.Board
    started: float
    ranks: layout.RankLayout = None
    task: object = None
    ds: dict = None
    """The DeepSpeed dict: planned, then final (app/ds/run_dict.py), as the engine and the checkpoints get it."""
    filled: dict = None
    note: str = ""
    """Why the precision was picked."""
    output_dir: Path = None
    data: tuple = ()
    """(train set, eval set, DataInfo)."""
    trained: object = None
    """The module the engine trains: the model, or this rank's pipeline stage of it."""
    saves: tuple = (None, None)
    """(extra(folder) files rank 0 saves, every_rank(engine, folder)) for each checkpoint."""
    flops: float = 0.0
    loaders: tuple = ()
    steps: int = 0
    state: TrainerState = None
    resumed: tuple = (None, None)
    """(checkpoint folder, its TrainerState) to resume from."""
    engine: object = None
    stop: preemption.StopRequest = None

    def trial_model(self, trial: dict):
        """A fresh model laid out for an engine of the trial dict (the micro batch search)."""
        return self.ranks.prepare(self.task.build_model(self.data[2], trial), self.task, self.settings.model, trial)[0]

    def save(self, step: int, epoch: int, batch: int):
        """A checkpoint at this point of the run: every rank's shards, rank 0's files."""
        save_checkpoint(self.engine, self.output_dir, self.state.at(step, epoch, batch), self.settings.keep_last,
                        *self.saves)


def run(settings: Settings, ds: dict, world: World, started: float) -> int:
    """One training job inside an existing process group: plan, build, fit, summarise; an error that ends it is
    one line (app/distributed/endings.py)."""
    job = Job(settings, world, endings.Board(), started)
    with endings.one_line(job.board, lambda: job.engine):
        try:
            plan(job, ds)
            build(job)
            return fit(job)
        finally:
            if job.stop is not None:
                job.stop.close()
            outdir.unlock()
            ds_internals.forget_parallel_groups()  # a later engine of this process (the benchmark's) picks its own


def plan(job: Job, ds: dict):
    """Before any engine: the layout, the task, the planned DeepSpeed dict, the output folder, the data, the micro
    batch; a mistake found here leaves the output folder as it was."""
    settings, world = job.settings, job.world
    job.ranks = layout.rank_layout(ds, world.world_size, world.rank, settings.deepspeed_config)
    job.task = tasks.build(settings)
    lora.check_layout(settings.lora, job.ranks)
    job.ds, job.filled, job.note = run_dict.planned(ds, settings.deepspeed_config, world.device, job.ranks.replicas,
                                                    tasks.auto_facts(job.task))
    job.output_dir = resume.output_dir_for(settings)
    seed_everything(settings.seed)
    job.data = job.task.build_data(job.output_dir)
    job.task = tasks.settled(job.task, job.ranks)
    job.ds, job.note = weighed(job)
    if job.data[2].packed and job.ranks.split:
        raise UserError("packing and pipeline stages: a stage takes input ids alone, not the position ids that keep "
                        "packed rows apart; pass --packing off")
    if hasattr(job.task, "build_reference"):  # preference: a frozen copy, before the micro batch search
        job.task.build_reference(job.ds, job.ranks.replicas, job.data[2])
    job.ds = autobatch.settle(job.ds, settings.deepspeed_config, job.ranks, job.task, job.trial_model, job.data[0],
                              job.output_dir, settings.resume, job.board)


def build(job: Job):
    """The model laid out, the loaders, the run's steps, the checkpoint to resume, the final DeepSpeed dict (built
    once), and the engine of exactly that dict."""
    settings, ranks, task, info = job.settings, job.ranks, job.task, job.data[2]
    model = task.build_model(info, job.ds)
    job.flops = task.flops_per_sample(model, info) if task.tokens_per_sample else 0.0  # before AutoTP shards it
    learnt = run_dict.trainable(model)  # the whole model's, the same on every rank
    job.trained, *job.saves = ranks.prepare(model, task, settings.model, job.ds)
    del model  # a pipeline stage keeps only its own layers
    job.loaders = loaders(job.data[0], job.data[1], job.ds, settings, job.world, ranks)
    job.steps = loop.total_steps(settings.max_steps, settings.epochs, len(job.loaders[0]),
                                 job.ds["gradient_accumulation_steps"])
    job.state = trainer_state(settings, job.world, ranks, info, job.ds, task)
    folder, saved, universal = resume.plan_resume(job.output_dir, settings.resume, job.state, settings.overwrite)
    job.resumed = folder, saved
    job.ds = job.state.deepspeed_config = run_dict.final(job.ds, job.filled, job.steps, universal, learnt, ranks.tensor)
    job.engine = loop.build_engine(job.trained, job.ds)


def fit(job: Job) -> int:
    """Say how the run is laid out, resume, train by the schedule, save; the summary and the exit code."""
    settings, world, engine, task, output_dir = job.settings, job.world, job.engine, job.task, job.output_dir
    tf32 = precision.set_tf32(world.device, precision.compute_dtype(engine), settings.tf32)
    say_mode(settings, world, engine, job.steps, output_dir, job.ranks, job.note, tf32)
    if job.data[2].packed:
        packing.check(engine, task, job.data[0])
    if job.filled:
        dist.print0(ds_auto.say(job.ds, job.filled, output_dir, dist.is_main()))
    rates = throughput_for(task, job.flops, engine, settings)
    folder, saved = job.resumed
    finished = saved is not None and saved.step >= job.steps  # nothing_to_do says so below
    if hasattr(task, "prepare") and not finished:  # preference: its reference, from the weights before any load
        task.prepare(engine, job.ds, output_dir)
    compiled = compiling.wanted(settings.compile, engine.device, getattr(task, "eager_because", lambda _: "")(engine))
    start = resume.load(engine, folder, saved, job.ranks.replicas) if folder else (0, 0)
    if loop.nothing_to_do(engine, job.steps):
        return 0
    outdir.clear(output_dir, folder, settings.overwrite)  # only now: a mistake found before leaves it all
    job.stop = preemption.StopRequest(job.board, settings.grace_period, world.launcher != "none")
    log = runlog.RunLog(output_dir, job.steps, engine.global_steps, throughput=rates,
                        columns=runlog.columns(task, *job.data[:2]))
    metrics.reset_peak_memory(world.device)  # the summary's peak is the training's, not the start-up probe's
    step = job.ranks.train_step(engine, task, compiled, job.board)
    schedule = loop.Schedule(job.steps, settings.log_interval, settings.eval_interval, settings.save_interval,
                             settings.max_nonfinite_steps)
    with log.discarded_on_error(lambda: complete_checkpoints(checkpoint_root(output_dir))):
        answers = sample_answers.for_run(engine, task, output_dir, settings.eval_answers, settings.answer_tokens)
        result = loop.Loop(step, *job.loaders, schedule, log, job.save, job.stop, answers).fit(start)
    return summarise(result, settings, world, engine, task, log, job.stop, job.started)


def trainer_state(settings: Settings, world: World, ranks, info, ds: dict, task) -> TrainerState:
    """What this run's checkpoints record besides DeepSpeed's shards, at step 0."""
    return TrainerState(step=0, epoch=0, batch=0, model=settings.model, dataset=settings.dataset,
                        world_size=world.world_size, zero_stage=ds_config.zero_stage(ds),
                        settings=settings_dict(settings), data_info=asdict(info), deepspeed_config=ds,
                        pipeline_stages=ranks.split.stages if ranks.split else 0,
                        data_parallel_size=ranks.replicas, tensor_parallel_size=ranks.tensor,
                        lora=lora.record(settings, getattr(task, "spec", None)),
                        preference=task.record() if hasattr(task, "record") else {})


def weighed(job: Job) -> tuple:
    """(DeepSpeed dict, why precision was picked) once the data has settled the task: on a GPU, the planned dict
    weighed against its memory (app/memory/fit.py); run_dict.final makes the run's dict of it."""
    ds, note, ranks = job.ds, job.note, job.ranks
    world = job.world
    if world.device.type != "cuda" or ranks.split or ranks.tensor > 1:  # a split model's bytes are its stages'
        return ds, note
    gpu = torch.cuda.get_device_properties(world.device).total_memory
    return dist.broadcast_object(weigh(ds, note, job.task, job.settings, ranks.replicas, gpu)
                                 if dist.is_main() else None)  # one decision, however the GPUs differ


def loaders(train_set, eval_set, ds: dict, settings: Settings, world: World, ranks: layout.RankLayout) -> tuple:
    """(train loader, eval loader) over this data-parallel replica's shard (the stages of a pipeline share one)."""
    workers, pin = feeding(train_set, world.device.type == "cuda", usable_cores() // world.local_world_size,
                           settings.num_workers, settings.pin_memory)
    if workers or pin:
        dist.print0(f"data: {workers} loader worker(s) per rank, {'pinned' if pin else 'pageable'} host memory")
    args = dict(rank=ranks.replica, world_size=ranks.replicas, seed=settings.seed, num_workers=workers,
                pin_memory=pin)
    micro = ds["train_micro_batch_size_per_gpu"]
    return (training_loader(train_set, micro, accumulation=ds["gradient_accumulation_steps"], **args),
            held_out_loaders(eval_set, micro, **args))


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
                                                        "eval_reward_accuracy", "samples_per_s", "tokens_per_s",
                                                        "mfu") if k in summary)
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
