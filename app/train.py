"""Train a model through DeepSpeed: parse, set up, settle, build, train, tear down (docs/architecture.md)."""
import gc
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if __package__ in (None, ""):  # run as `python app/train.py` or by a launcher: make `app` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from app.checkpoint import outdir, resume
from app.checkpoint.save import TrainerState, checkpoint_root, complete_checkpoints, save_checkpoint
from app.core import answers as sample_answers, compiling, early_stop, loop, lora, resolver
from app.core.task import Task
from app.data.loader import run_loaders
from app.distributed import dist, endings, launch, node_shell, preemption
from app.distributed.dist import World
from app.ds import auto as ds_auto, config as ds_config, internals as ds_internals, precision, run_dict
from app.errors import Ended, UserError, report
from app.memory import autobatch, nvme
from app.memory.planner import held_after_search, weighed_for_run
from app.observe import memory_snapshot, metrics, runlog, startup, trackers
from app.observe import profiler as profiling
from app.observe.summary import summarise
from app.parallel import layout, sequence_parallel, tiled
from app.settings import Settings, parse

if TYPE_CHECKING:
    import deepspeed


def seed_everything(seed: int):
    """The same seed on every rank: identical initial weights and data order."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


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
class Settled:
    """What a run settles before any engine, a mistake found until then leaving the output folder as it was: the
    layout, the task holding its data, the DeepSpeed dict ("auto" filled, micro batch settled), what "auto" filled,
    why the precision was picked, the output folder."""
    ranks: layout.RankLayout
    task: Task
    ds: dict
    filled: dict
    note: str
    output_dir: Path


@dataclass
class Built:
    """The engine of the run's final dict (state.deepspeed_config) and what training needs: the (train, held-out)
    loaders, the steps, the checkpoints' TrainerState, the checkpoint to resume and its state (or None and None),
    the FLOPs of a sample, (rank 0's extra files, every rank's save) for each checkpoint."""
    engine: "deepspeed.DeepSpeedEngine"
    loaders: tuple
    steps: int
    state: TrainerState
    resume_from: Path | None
    saved: TrainerState | None
    flops: float
    saves: tuple


@dataclass
class Job:
    """One training run: its settings and world, then what settle() and build() made of them."""
    settings: Settings
    world: World
    board: endings.Board
    started: float
    settled: Settled | None = None
    built: Built | None = None

    def engine(self):
        """The engine once built, else None (an error's line says the step it ended in)."""
        return self.built.engine if self.built else None


def run(settings: Settings, ds: dict, world: World, started: float) -> int:
    """One training job inside an existing process group: settle, build, train, summarise; an error that ends it
    is one line (app/distributed/endings.py)."""
    job = Job(settings, world, endings.Board(), started)
    with memory_snapshot.Recorder(settings.memory_snapshot, world.device) as memory, \
            endings.one_line(job.board, job.engine, memory.written):  # the snapshot written before recording stops
        try:
            job.settled = settle(settings, world, ds, job.board)
            memory.start(job.settled.output_dir)  # after the micro batch search's trials, before the model is built
            job.built = build(settings, world, job.settled)
            return train(job)
        except BaseException:
            trackers.finish_open(failed=True)
            raise
        finally:
            trackers.finish_open(failed=False)  # a tracker's run that training's log never took over
            outdir.unlock()
            ds_internals.forget_parallel_groups()  # a later engine of this process (the benchmark's) picks its own


def settle(settings: Settings, world: World, ds: dict, board: endings.Board) -> Settled:
    """Before any engine, in this order: the rank layout, the planned DeepSpeed dict (and an NVMe offload's folders
    and op), the output folder, the task and its data, the precision weighed against the GPU and what the ranks
    offload against the host, the task's own engines, the micro batch (and the host again where its search set the
    accumulation)."""
    ranks = layout.rank_layout(ds, world.world_size, world.rank, settings.deepspeed_config)
    if settings.early_stopping_metric:  # a mistake there is one line before anything is built
        early_stop.watched(settings.early_stopping_metric)
    spec = resolver.spec_of(settings)
    lora.check_flags(settings)
    lora.check_layout(settings.lora, ranks)
    tiled.check_layout(settings.tiled, ranks)
    ds, filled, note = run_dict.planned(ds, settings.deepspeed_config, world.device, ranks.replicas,
                                        resolver.auto_facts(spec, world.device))
    ds = trackers.enabled(ds, settings.report_to)  # --report_to's DeepSpeed monitors; one that cannot start: a line
    nvme.check(ds, settings.deepspeed_config)  # an NVMe offload's folders and op, before any engine
    output_dir = resume.output_dir_for(settings)
    seed_everything(settings.seed)
    task = resolver.resolve(sequence_parallel.settings_for(settings, ranks.sequence), spec, output_dir)
    task.check_layout(ranks)
    ds, note = weighed_for_run(ds, note, task, settings, ranks, world)
    task.before_search(ds, ranks.replicas)

    def trial_model(trial: dict):  # a fresh model laid out for an engine of the micro batch search's trial dict
        return ranks.prepare(task.build_model(task.data.info, trial), task, settings.model, trial)[0]
    searched = autobatch.settle(ds, settings.deepspeed_config, ranks, task, trial_model, task.data.train, output_dir,
                                settings.resume, board)
    held_after_search(ds, searched, task, settings, ranks, world)
    return Settled(ranks, task, searched, filled, note, output_dir)


def build(settings: Settings, world: World, settled: Settled) -> Built:
    """The model laid out, the loaders, the run's steps, the checkpoint to resume, the final DeepSpeed dict (made
    once), and the engine of exactly that dict."""
    ranks, task, info = settled.ranks, settled.task, settled.task.data.info
    model = task.build_model(info, settled.ds)
    flops = task.flops_per_sample(model, info) if task.tokens_per_sample else 0.0  # before AutoTP shards it
    learnt = run_dict.trainable(model)  # the whole model's, the same on every rank
    trained, *saves = ranks.prepare(model, task, settings.model, settled.ds)
    del model  # a pipeline stage keeps only its own layers
    loaders = run_loaders(task.data, settled.ds, settings, world, ranks)
    steps = loop.total_steps(settings.max_steps, settings.epochs, len(loaders[0]),
                             settled.ds["gradient_accumulation_steps"])
    state = TrainerState(step=0, epoch=0, batch=0, model=settings.model, dataset=settings.dataset,  # what checkpoints
                         world_size=world.world_size, zero_stage=ds_config.zero_stage(settled.ds),  # record, at step 0
                         settings=asdict(settings), data_info=asdict(info), deepspeed_config=settled.ds,
                         pipeline_stages=ranks.split.stages if ranks.split else 0, data_parallel_size=ranks.replicas,
                         tensor_parallel_size=ranks.tensor, lora=lora.record(settings, task.spec),
                         task_record=task.record())
    folder, saved, universal = resume.checkpoint_to_resume(settled.output_dir, settings.resume, state,
                                                           settings.overwrite)
    state.deepspeed_config = run_dict.final(settled.ds, settled.filled, steps, universal, learnt, ranks.tensor)
    return Built(loop.build_engine(trained, state.deepspeed_config), loaders, steps, state, folder, saved, flops,
                 tuple(saves))


def train(job: Job) -> int:
    """Say how the run is laid out, resume, train by the schedule, save; the summary and the exit code."""
    settings, world, settled, built = job.settings, job.world, job.settled, job.built
    ranks, task, output_dir, engine = settled.ranks, settled.task, settled.output_dir, built.engine
    profiler = profiling.for_run(settings.profile, settings.profile_ranks, built.steps, output_dir, engine.device)
    tf32 = precision.set_tf32(world.device, precision.compute_dtype(engine), settings.tf32)
    startup.say_mode(world.description, engine, built.steps, output_dir, ranks.replicas,
                     [ranks.describe(engine, task), lora.describe(engine.module) if settings.lora else ""], settled.note,
                     tf32)
    if settled.filled:
        dist.print0(ds_auto.say(built.state.deepspeed_config, settled.filled, output_dir, dist.is_main()))
    rates = metrics.throughput_for(task.tokens_per_sample, built.flops, engine.device,
                                   precision.compute_dtype(engine), settings.peak_flops)
    if not (built.saved is not None and built.saved.step >= built.steps):  # nothing_to_do says so below
        task.before_load(engine, built.state.deepspeed_config, output_dir)
    compiled = compiling.wanted(settings.compile, engine.device, task.eager_because(engine.zero_optimization_stage()),
                                engine.is_deepcompile_enabled())
    resumed = built.resume_from
    start = resume.load(engine, task, resumed, built.saved, ranks.replicas) if resumed else (0, 0)
    early = early_stop.for_run(settings, built.saved, task)
    if loop.nothing_to_do(engine, built.steps) or early is not None and early.ended_before():
        return 0
    outdir.clear(output_dir, built.resume_from, settings.overwrite)  # only now: a mistake found before leaves it all
    log = runlog.RunLog(output_dir, built.steps, engine.global_steps, throughput=rates,
                        columns=runlog.columns(task, task.data.train, task.data.held_out),
                        trackers=trackers.for_run(engine, settings, output_dir.name))
    metrics.reset_peak_memory(world.device)  # the summary's peak is the training's, not the start-up probe's
    step = ranks.train_step(engine, task, compiled, job.board)
    schedule = loop.Schedule(built.steps, settings.log_interval, settings.eval_interval, settings.save_interval,
                             settings.max_nonfinite_steps)
    with preemption.StopRequest(job.board, settings.grace_period, world.launcher != "none") as stop, \
            log.discarded_on_error(lambda: complete_checkpoints(checkpoint_root(output_dir))):
        answers = sample_answers.for_run(engine, task, output_dir, settings.eval_answers, settings.answer_tokens)
        save = saver(engine, output_dir, built, settings.keep_last, early)
        result = loop.Loop(step, *built.loaders, schedule, log, save, stop, answers, profiler, early).run(start)
    return summarise(result, settings, world, engine, task, log, stop, job.started)


def saver(engine, output_dir: Path, built: Built, keep_last: int, early):
    """save(step, epoch, batch): every rank's shards and rank 0's files of a checkpoint, with early stopping's
    count, keeping the newest keep_last and --keep_best's."""
    def save(at: int, epoch: int, batch: int):
        record = {"early_stopping": early.record()} if early is not None else {}
        save_checkpoint(engine, output_dir, built.state.at(at, epoch, batch, **record), keep_last, *built.saves,
                        kept=early.kept_step() if early is not None else 0)
    return save


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
