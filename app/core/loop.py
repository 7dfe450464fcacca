"""The engine, and the training loop, whose schedule says when to log, evaluate, save and stop; the training step it
runs is app/core/step.py's."""
from dataclasses import dataclass

from app.core.divergence import Divergence
from app.distributed import dist
from app.ds import internals as ds_internals
from app.errors import UserError, deepspeed_failure
from app.observe.metrics import Meter, Stopwatch
from app.observe.runlog import RunLog


def build_engine(model, ds_config: dict):
    """deepspeed.initialize of exactly ds_config (app/ds/run_dict.py makes a run's), with DeepSpeed's complaints
    about the config turned into one line."""
    import deepspeed
    try:
        trained = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters alone
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trained, config=ds_config,
                                               mpu=ds_internals.sequence_groups(ds_config))
    except (TypeError, ValueError, AssertionError, KeyError) as e:
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"DeepSpeed could not build the engine from this config: {text}") from None
    except (RuntimeError, AttributeError, NotImplementedError, IndexError) as e:
        said = deepspeed_failure(e, "building the engine")
        if said is None:
            raise
        raise said from None
    plain = engine.zero_optimization_stage() == 0 and not (engine.fp16_enabled() or engine.bfloat16_enabled())
    if plain and not engine.pipeline_parallelism and engine.autotp_size() <= 1:  # there, ranks hold parts of them
        ds_internals.lighten_plain_step(engine)
    elif plain:
        ds_internals.note_clip_norms(engine)  # the norm's verdict for app/core/divergence.py
    ds_internals.skip_bad_steps_on_device(engine)  # ZeRO 1-3: no host sync to check the gradient norm
    ds_internals.step_bf16_weights_on_device(engine)  # ZeRO 0 with bf16 weights: nor there
    ds_internals.constants_on_device()  # nor to copy DeepSpeed's constants from the host
    return engine


def total_steps(max_steps: int, epochs: int, batches_per_epoch: int, accumulation: int) -> int:
    """Optimizer steps the run will take: max_steps when set, else whole epochs."""
    steps = max_steps or (epochs * batches_per_epoch) // accumulation
    if steps < 1:
        raise UserError(f"{epochs} epoch(s) of {batches_per_epoch} micro batches make no optimizer step with "
                        f"gradient_accumulation_steps {accumulation}; raise --epochs or set --max_steps")
    return steps


def nothing_to_do(engine, steps: int) -> bool:
    """True (and says so) when the checkpoint resumed from is already at or past the run's last step."""
    if engine.global_steps < steps:
        return False
    dist.print0(f"nothing to do: the checkpoint is at step {engine.global_steps} and this run ends at "
                f"step {steps}; raise --max_steps or --epochs to train further")
    return True


@dataclass
class Schedule:
    """When the loop logs, evaluates, saves and stops, counted in optimizer steps."""
    total_steps: int
    log_interval: int = 10
    eval_interval: int = 0
    """0: evaluate at the end of each epoch. Always at the last step."""
    save_interval: int = 0
    """0: save only at the last step (or when stopped early)."""
    max_nonfinite_steps: int = 10
    """Steps in a row whose loss or gradient norm is not finite that end the run (0: never)."""

    def log_now(self, step: int, stopping: bool) -> bool:
        return step % self.log_interval == 0 or step >= self.total_steps or stopping

    def eval_now(self, step: int) -> bool:
        return step >= self.total_steps or bool(self.eval_interval and step % self.eval_interval == 0)

    def eval_after_epoch(self, step: int) -> bool:
        """Evaluate at an epoch's end (when no interval is set and the last step has not evaluated already)."""
        return not self.eval_interval and step < self.total_steps

    def save_now(self, step: int, stopping: bool) -> bool:
        return step >= self.total_steps or stopping or bool(self.save_interval and step % self.save_interval == 0)

    def finished(self, step: int) -> bool:
        return step >= self.total_steps


def evaluate(step, loaders) -> dict:
    """The step's evaluation of the held-out set, or of each source's (loaders: {name: loader}) and all of them
    together: each source's metrics as eval_x/<name>, and as eval_x their means weighted by the units (samples or
    answer tokens) each source holds, the task's derived ones (perplexity) from the combined loss."""
    if not isinstance(loaders, dict):
        return step.evaluate(loaders)
    parts = {name: step.evaluate(loader) for name, loader in loaders.items()}
    units = {name: loader.total_units() for name, loader in loaders.items()}
    derived = set(step.task.eval_metrics(1.0))
    combined = {key: sum(parts[name][key] * units[name] for name in parts) / sum(units.values())
                for key in next(iter(parts.values())) if key not in derived}
    combined.update(step.task.eval_metrics(combined["eval_loss"]))
    return {**combined, **{f"{key}/{name}": value for name, result in parts.items() for key, value in result.items()}}


class Loop:
    """Trains through the loaders by the schedule: micro steps, then at each optimizer step the log row,
    evaluation and checkpoint it calls for; stops at the last step or when every rank agrees to stop."""

    def __init__(self, step, train_loader, eval_loader, schedule: Schedule, log: RunLog, save=None, stop=None,
                 answers=None, profiler=None, early=None):
        """step: the training step, a step.TrainStep or, on a pipeline, a pipeline.PipeStep (both give micro_step
        and evaluate); save(step, epoch, batch) writes a checkpoint; stop.agreed(step) says when every rank
        stops; answers(step), after each evaluation, shows the model's answers (app/core/answers.py);
        profiler.at(steps done), before the first step and after each, and finish(steps done) at the end
        (app/observe/profiler.py); early, an early_stop.EarlyStopping, judges each evaluation: it may stop the
        run, and with keep_best a new best is saved at once."""
        self.step, self.engine = step, step.engine
        self.train_loader, self.eval_loader, self.schedule, self.log = train_loader, eval_loader, schedule, log
        self.save, self.stop, self.answers, self.profiler, self.early = save, stop, answers, profiler, early
        self.early_stopped, self.save_after_epoch = False, False
        self.meter, self.clock = Meter(step.metrics, self.engine.device, self.engine.autotp_size()), Stopwatch()
        self.divergence = Divergence(self.engine, schedule.max_nonfinite_steps)
        self.samples, self.seconds, self.last_eval, self.stopped = 0.0, 0.0, {}, False
        self.position = None  # (epoch, micro batches done in it) at the last log row
        self.boundary = (0, 0)  # where the data stood at the last optimizer step: what a checkpoint resumes at

    def run(self, start=(0, 0)) -> dict:
        """Train from (epoch, micro batch) start; the run's totals and its last evaluation."""
        epoch, skip = self.boundary = start
        if self.profiler is not None:
            self.profiler.at(self.engine.global_steps)
        self.clock.lap()
        self.engine.train()
        while not self._done():
            self.train_loader.set_epoch(epoch, skip)
            for batch_index, batch in enumerate(self.train_loader, start=skip + 1):
                before = self.engine.global_steps
                self.step.micro_step(batch, self.meter)
                if self.engine.global_steps == before:
                    continue  # inside a gradient accumulation window
                self._after_step(epoch, batch_index)
                if self._done():
                    break
            else:  # the epoch ran to its end
                evaluated = self.schedule.eval_after_epoch(self.engine.global_steps) and self._evaluate(epoch)
                if evaluated or self.save_after_epoch:  # mid-window, the window's batches train again on resume
                    self._save(*self.boundary)
                self.save_after_epoch = False
            epoch, skip = epoch + 1, 0
        if self.profiler is not None:
            self.profiler.finish(self.engine.global_steps)
        return {"steps": self.engine.global_steps, "epochs": epoch, "samples": self.samples,
                "train_s": self.seconds, **self.log.rates(self.samples, self.seconds),
                "skipped_steps": self.engine.skipped_steps, "stopped_early": self.stopped and not self.early_stopped,
                **({"early_stopping": {**self.early.record(), "stopped": self.early_stopped, "why": self.early.why()}}
                   if self.early else {}),
                **self.last_eval,
                **(self.train_loader.drawn(*self.position) if self.position else {})}

    def _done(self) -> bool:
        return self.schedule.finished(self.engine.global_steps) or self.stopped

    def _after_step(self, epoch: int, batch_index: int):
        """What the schedule asks for after an optimizer step: a log row, an evaluation, a checkpoint."""
        step, schedule = self.engine.global_steps, self.schedule
        done = batch_index == len(self.train_loader)
        self.boundary = (epoch + 1, 0) if done else (epoch, batch_index)
        self.log.advance(1)
        self.divergence.stepped(self.meter.take_not_finite())
        self.stopped = self.stop is not None and self.stop.agreed(step)
        if schedule.log_now(step, self.stopped):
            skipped = self.divergence.check()
            result, elapsed = self.meter.reduce(), self.clock.lap()
            self.samples, self.seconds = self.samples + result["count"], self.seconds + elapsed
            extra = {name: result[name] for name in self.meter.names if name != "loss"}  # preference: rewards
            self.position = epoch, batch_index
            extra.update(self.train_loader.drawn(epoch, batch_index))  # several sources: each one's
            self.log.train_row(step, epoch, result["loss"], self.engine.get_lr()[0], result["count"], elapsed,
                               skipped, extra)
        save_best = schedule.eval_now(step) and self._evaluate(epoch)
        if save_best or schedule.save_now(step, self.stopped):
            if done and not self.stopped and schedule.eval_after_epoch(step):
                self.save_after_epoch = True  # after the epoch's evaluation, whose verdict the checkpoint keeps
            else:
                self._save(*self.boundary)
        if self.profiler is not None:  # after the step's own evaluation and save, which its trace holds
            self.profiler.at(step)

    def _save(self, epoch: int, batch: int):
        """A checkpoint of this step, to continue at (epoch, batch)."""
        if self.save is not None:
            with self.clock.paused():  # saving does not count against training throughput
                self.divergence.before_save()
                self.save(self.engine.global_steps, epoch, batch)

    def _evaluate(self, epoch: int) -> bool:
        """Evaluate, log, show answers, and judge the evaluation (early stopping); True when it is a new best that
        --keep_best saves, or the one that stops the run."""
        step = self.engine.global_steps
        with self.clock.paused():  # nor does evaluation
            self.last_eval = evaluate(self.step, self.eval_loader)
            self.log.write_row({"step": step, "epoch": epoch, **self.last_eval})
            if self.answers is not None:
                self.answers(step)
        if self.early is None:
            return False
        best = self.early.update(step, self.last_eval)
        if self.early.stop() and not self.stopped:
            self.stopped = self.early_stopped = True
            self.log.message(f"early stopping at step {step}: {self.early.why()}")
        return (best and self.early.keep_best) or self.early_stopped
