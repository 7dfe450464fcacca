"""The engine, the training step, evaluation, and the fit loop."""
import math
import time

import torch

from app.compiler import Step, wanted
from app.errors import UserError
from app.metrics import Meter, Throughput
from app.models import correct


def build_engine(model, ds_config: dict):
    """deepspeed.initialize, with DeepSpeed's complaints about the config turned into one line."""
    import deepspeed
    # The app times its own steps. DeepSpeed's throughput timer would synchronise the GPU in every forward and,
    # read by its forward hook, recompile a compiled model at each of the first steps; off unless the JSON sets it.
    ds_config = {"timers": {"throughput": {"enabled": False}}, **ds_config}
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    except (TypeError, ValueError, AssertionError, KeyError) as e:
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"DeepSpeed could not build the engine from this config: {text}") from None
    if engine.zero_optimization_stage() == 0 and not (engine.fp16_enabled() or engine.bfloat16_enabled()):
        _lighten_plain_step(engine)
    return engine


def _lighten_plain_step(engine):
    """Drop work plain fp32 data parallel does not need (measured with app.bench: ~20% of a small model's step).

    DeepSpeed's clipping takes one norm per tensor and all-reduces the total every step (for MoE
    models, whose grads differ by rank); after the gradient all-reduce every rank holds the same
    grads, so torch's foreach clip gives the same norm with no collective. One rank has nothing to
    average, so its gradient all-reduce (a flatten, a collective and a copy back) is skipped.
    """
    import torch.distributed as dist
    engine.clip_fp32_gradients = lambda: torch.nn.utils.clip_grad_norm_(
        engine.module.parameters(), engine.gradient_clipping(), foreach=True)
    if dist.get_world_size() == 1:
        engine.enable_backward_allreduce = False


def input_dtype(engine) -> torch.dtype:
    """The dtype the engine's parameters are kept in for the forward pass."""
    if engine.bfloat16_enabled():
        return torch.bfloat16
    if engine.fp16_enabled():
        return torch.float16
    return torch.float32


def _to_device(batch, device, dtype):
    """(model inputs as a list, labels, weights) on the device; floating inputs in the engine's dtype."""
    x, y, w = batch
    inputs = [t.to(device, non_blocking=True) for t in (x if isinstance(x, (list, tuple)) else [x])]
    inputs = [t.to(dtype) if t.is_floating_point() else t for t in inputs]
    return inputs, y.to(device, non_blocking=True), w.to(device, non_blocking=True)


def train_step(step: Step, batch, dtype, meter: Meter):
    """Forward, engine.backward(loss), engine.step(); the loss is weighted so ranks average exactly."""
    engine = step.engine
    x, y, w = _to_device(batch, engine.device, dtype)
    _, losses = step.logits_and_losses(x, y)
    engine.backward((losses * w).sum())
    engine.step()
    real = (w > 0).to(losses.dtype)
    meter.add(real.sum(), loss=(losses.detach() * real).sum())


def evaluate(step: Step, loader, dtype) -> dict:
    """Held-out loss and accuracy (and perplexity for language models) over every rank's shard, padding excluded."""
    engine = step.engine
    meter = Meter(["loss", "accuracy"], engine.device)
    engine.eval()
    tokens = False
    with torch.no_grad():
        for batch in loader:
            x, y, w = _to_device(batch, engine.device, dtype)
            logits, losses = step.logits_and_losses(x, y)
            tokens = logits.dim() == 3
            real = (w > 0).float()
            meter.add(real.sum(), loss=(losses * real).sum(),
                      accuracy=(correct(logits, y) * real).sum())
    engine.train()
    result = meter.reduce()
    perplexity = {"eval_perplexity": math.exp(min(result["loss"], 700))} if tokens else {}
    return {"eval_loss": result["loss"], "eval_accuracy": result["accuracy"], **perplexity}


def total_steps(max_steps: int, epochs: int, batches_per_epoch: int, accumulation: int) -> int:
    """Optimizer steps the run will take: max_steps when set, else whole epochs."""
    steps = max_steps or (epochs * batches_per_epoch) // accumulation
    if steps < 1:
        raise UserError(f"{epochs} epoch(s) of {batches_per_epoch} micro batches make no optimizer step with "
                        f"gradient_accumulation_steps {accumulation}; raise --epochs or set --max_steps")
    return steps


def fit(engine, train_loader, eval_loader, settings, log, steps: int, start=(0, 0), save=None, stop=None,
        throughput: Throughput = Throughput()) -> dict:
    """Train until `steps` optimizer steps (or an agreed stop), from (epoch, batch) `start`, logging,
    evaluating and saving."""
    dtype = input_dtype(engine)
    step_fn = Step(engine, wanted(settings.compile, engine.device))
    meter = Meter(["loss"], engine.device)
    sampler = train_loader.batch_sampler
    samples, train_s, last_eval, stopped = 0.0, 0.0, {}, False
    epoch, skip = start
    window = time.perf_counter()
    engine.train()
    while engine.global_steps < steps and not stopped:
        sampler.set_epoch(epoch, skip)
        for batch_index, batch in enumerate(train_loader, start=skip + 1):
            before = engine.global_steps
            train_step(step_fn, batch, dtype, meter)
            step = engine.global_steps
            if step == before:
                continue  # inside a gradient accumulation window
            log.advance(1)
            stopped = stop is not None and stop.agreed()
            if step % settings.log_interval == 0 or step == steps or stopped:
                result = meter.reduce()
                elapsed = time.perf_counter() - window
                samples, train_s = samples + result["count"], train_s + elapsed
                log.write_row({"step": step, "epoch": epoch, "loss": result["loss"], "lr": engine.get_lr()[0],
                               **throughput.rates(result["count"], elapsed)})
                window = time.perf_counter()
            if step == steps or (settings.eval_interval and step % settings.eval_interval == 0):
                last_eval, spent = _eval_row(step_fn, eval_loader, dtype, log, step, epoch)
                window += spent  # evaluation time does not count against training throughput
            if save and (step == steps or stopped or (settings.save_interval and step % settings.save_interval == 0)):
                started = time.perf_counter()
                done = batch_index == len(train_loader)
                save({"step": step, "epoch": epoch + done, "batch": 0 if done else batch_index})
                window += time.perf_counter() - started
            if step >= steps or stopped:
                break
        else:
            if not settings.eval_interval and engine.global_steps < steps:
                last_eval, spent = _eval_row(step_fn, eval_loader, dtype, log, engine.global_steps, epoch)
                window += spent
        epoch, skip = epoch + 1, 0
    if stop is not None:
        stop.finish()
    return {"steps": engine.global_steps, "epochs": epoch, "samples": samples, "train_s": train_s,
            **throughput.rates(samples, train_s), "stopped_early": stopped, **last_eval}


def _eval_row(step_fn: Step, loader, dtype, log, step, epoch):
    start = time.perf_counter()
    result = evaluate(step_fn, loader, dtype)
    log.write_row({"step": step, "epoch": epoch, **result})
    return result, time.perf_counter() - start
