"""What the benchmark measures: each mode's training loop on the same model, data and global batch, timed
step by step on every rank. The app modes run the app's own loop (app/core/loop.py), not a copy of it."""
import gc
import logging
import statistics
import weakref

import torch

from app.ds.internals import torch_private
from app.parallel import activations
from app.core import compiling
from app.ds import precision
from app.distributed import dist
from app.ds import internals as ds_internals
from app.ds import run_dict
from app.core import loop
from app.observe import metrics
from app.parallel import layout
from app.observe import runlog
from app.core import resolver
from app.settings import Settings
from app.data.loader import build_loader
from app.tools.bench_common import Clock, TimedLoader, Workload, build_model, param_bytes
from app.tools.bench_fsdp import run_fsdp2
from app.tools.bench_profile import EXTRA_STEPS as PROFILED_STEPS, Profile, graphs_made
from app.tools.bench_report import TORCH_MODES
from app.tools.bench_torch import run_torch

_ended = []  # (mode, weak reference to its engine) of each app mode this process ran
LORA = "+lora"  # the app mode's name for its run with LoRA adapters on the frozen model
COMPILE_SUFFIX = {"on": "compile", "off": "eager", "auto": "auto"}  # app mode names: zero1+compile, zero1+eager


def build_workload(args) -> Workload:
    """The model's task with as many samples as the run uses: random token blocks for language models, else digits."""
    task = resolver.build(Settings(model=args.model))
    train_set, info = task.sample_data(args.batch * (args.steps + args.warmup + 1), args.seq_len)
    return Workload(task, train_set, info)


def rank_layout_of(mode, args, world) -> layout.RankLayout:
    """How the mode lays out its ranks: an app mode's ds_config may split the model into pipeline stages or
    tensor-parallel shards, which share one replica's data; every other mode is data parallel."""
    config = args.configs.get(mode.partition("+")[0]) if mode not in TORCH_MODES else None
    return layout.rank_layout(config or {}, world.world_size, world.rank, mode)


def run_app(mode, args, world, work: Workload, loader, clock, total):  # long: the engine, the timed step, the Loop
    """The app's own path: the task's model (split or sharded as its ds_config says), build_engine with the real
    ds_config, the app's Loop; returns (the ZeRO state, dtype, compiled, parameter bytes of this rank)."""
    name, *suffixes = mode.split("+")
    labels = {label: choice for choice, label in COMPILE_SUFFIX.items()}
    choice = next((labels[s] for s in suffixes if s in labels), "auto")
    ranks = rank_layout_of(mode, args, world)
    ds = _engine_dict(mode, args.configs[name], work, world, loader.micro_batch, ranks.replicas, total)
    module, _, _ = ranks.prepare(build_model(work, ds, mode.endswith(LORA)), work.task, args.model, ds)
    engine = loop.build_engine(module, run_dict.for_engine(ds, run_dict.trainable(module), ranks.tensor))
    micro = loader.micro_batch  # a pipeline's stages pass activations of one fixed shape
    eval_loader = build_loader(torch.utils.data.Subset(work.train_set, range(ranks.replicas * micro)), micro,
                               ranks.replica, ranks.replicas, False, 0)
    state, real_step, real_reduce = {}, engine.optimizer.step, engine.allreduce_gradients

    def reduce_after_reading(*a, **kw):  # the end of the backward: ZeRO-1 holds every gradient whole here
        if engine.global_steps == 1:
            state["grads_at_backward_end"] = ds_internals.storages(ds_internals.zero_tensors(engine)["grads"])
        return real_reduce(*a, **kw)

    def step_and_tick(*a, **kw):  # the optimizer state exists from step 2; ZeRO-2's gradients are whole here
        if engine.global_steps == 1:
            state.update(zero_state(engine, name, sum(state.pop("grads_at_backward_end", {}).values())))
        result = real_step(*a, **kw)
        clock.tick()
        return result
    engine.optimizer.step, engine.allreduce_gradients = step_and_tick, reduce_after_reading
    step = ranks.train_step(engine, work.task,
                            compiling.wanted(choice, engine.device, deepcompile=engine.is_deepcompile_enabled()))
    precision.set_tf32(world.device, precision.compute_dtype(engine), "on")  # as train.py does
    schedule = loop.Schedule(total, log_interval=10, eval_interval=total)
    try:
        loop.Loop(step, TimedLoader(loader, clock), eval_loader, schedule, runlog.RunLog(None, total)).run()
        compiled = engine.is_compiled and step.compiled  # False once it fell back to eager
        return state or None, precision.compute_dtype(engine), compiled, param_bytes(engine.module)
    finally:
        engine.destroy()  # its hooks on the parameters (held by torch's autograd, out of gc's sight) go
        forget_engines()
        _ended.append((mode, weakref.ref(engine)))


def _engine_dict(mode, config: dict, work: Workload, world, micro: int, replicas: int, total: int) -> dict:
    """The mode's DeepSpeed dict (run_dict.for_benchmark), and a line where the device turned a setting of the
    file off, as a run says it (DeepCompile on CPU ranks)."""
    ds, filled = run_dict.for_benchmark(config, micro, resolver.auto_facts(work.task.spec, world.device), replicas,
                                        total, mode.split("+")[0])
    if "compile.deepcompile" in filled:
        dist.print0(f"{mode}: compile.deepcompile = false ({filled['compile.deepcompile']})")
    return ds


def still_held() -> list:
    """The app modes ended in this process whose engine something still holds (collected first), such as a global
    of DeepSpeed's that forget_engines does not clear: its memory then counts in every later mode's peak."""
    gc.collect()
    return [mode for mode, engine in _ended if engine() is not None]


def forget_engines():
    """Let go of what DeepSpeed's globals keep of a mode's engine, so that the next mode of this process starts as
    in a process of its own: ZeRO-3's module stack and its coordinator's cache (either holds the engine, its states
    and partitions, on the GPU), a pipeline's grid, and DeepSpeed's memory-efficient linear in torch's place."""
    ds_internals.forget_unfinished_forward()
    ds_internals.forget_released_params()
    ds_internals.forget_parallel_groups()
    ds_internals.restore_torch_linear()


def zero_state(engine, name, backward_grads: int = 0) -> dict:
    """Per-rank bytes of parameters, gradients (their peak: now, inside the step, or backward_grads, read at the end
    of the backward) and optimizer state, read from the engine's tensors, beside the ZeRO paper's formula adapted
    to fp32 (params 4, grads 4, Adam moments 8 bytes per parameter)."""
    stage, n = engine.zero_optimization_stage(), dist.world_size()
    psi = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    tensors = ds_internals.zero_tensors(engine)
    params = ds_internals.storages(tensors["params"])
    master = {k: v for k, v in ds_internals.storages(tensors["masters"]).items() if k not in params}
    shares = (4 / n if stage >= 3 else 4, 4 / n if stage >= 2 else 4, 8 / n if stage >= 1 else 8)
    formula = sum(shares) * psi
    held = {"params_bytes": params, "grads_bytes": ds_internals.storages(tensors["grads"]),
            "optimizer_bytes": ds_internals.storages(tensors["moments"]), "master_copy_bytes": master}
    held = {key: sum(value.values()) for key, value in held.items()}
    held["grads_bytes"] = max(held["grads_bytes"], backward_grads)
    measured = sum(held.values())
    return {"config": name, "stage": stage, "parameters": psi, **held, "measured_bytes": measured,
            "formula_bytes": int(formula), "measured_over_formula": measured / formula,
            "without_master_over_formula": (measured - held["master_copy_bytes"]) / formula}


def measure(mode, args, world, threads, per_rank_batch, work: Workload) -> dict:
    """Run one mode for warm-up + measured steps on every rank of this group; the reduced fields (rank 0 uses them)."""
    _start_mode(mode, world, threads)
    clock = Clock(world.device)
    ranks = rank_layout_of(mode, args, world)
    loader = build_loader(work.train_set, per_rank_batch, ranks.replica, ranks.replicas, True, 0)
    zero, dtype, compiled, held, graphs = _run(mode, args, world, work, loader, clock)
    first_step, times, waits = clock.measured(args.warmup, args.steps)
    wait_share = sum(waits) / sum(times)
    dist.barrier()  # every rank probes the matmul rate at once, as they shared the machine while training
    peak = metrics.matmul_flops(world.device, dtype, 0.1 if args.quick else 0.5)  # in the mode's own dtype
    datasheet = metrics.datasheet_flops(world.device, dtype)
    step_time, wait_share, first_step = dist.host_max([statistics.median(times), wait_share, first_step])
    peak = dist.host_sum([peak])[0]
    memory, held = _each_rank(world, metrics.peak_memory_bytes(world.device)), _each_rank(world, held)
    host = _each_rank(world, metrics.peak_memory_bytes(torch.device("cpu")))
    global_batch = per_rank_batch * ranks.replicas
    flops = args.lora_flops_per_sample if mode.endswith(LORA) else args.flops_per_sample  # frozen weights: 4 not 6
    samples_per_s = global_batch / step_time
    datasheet = datasheet and datasheet * world.world_size
    return {"mode": mode, "ranks": world.world_size, "threads_per_rank": threads,
            "micro_batch": per_rank_batch, "global_batch": global_batch, "dtype": str(dtype)[6:],
            "compiled": compiled, "pipeline_stages": ranks.split.stages if ranks.split else 1,
            "tensor_parallel": ranks.tensor, "step_time_s": step_time,
            "activation_checkpointing": activations.SECTION in (args.configs.get(mode.partition("+")[0]) or {}),
            "samples_per_s": samples_per_s,
            "tokens_per_s": samples_per_s * work.info.seq_len if work.info.seq_len else None,
            "mfu": samples_per_s * flops / peak, "peak_flops": peak,
            "mfu_datasheet": datasheet and samples_per_s * flops / datasheet,
            "datasheet_flops": datasheet,
            "data_wait_share": wait_share, "time_to_first_step_s": first_step,
            "peak_memory_bytes": [int(m) for m in memory], "param_bytes": [int(b) for b in held],
            "zero_state": zero, "host_peak_bytes": [int(m) for m in host], "graphs": list(graphs)}


def _run(mode, args, world, work: Workload, loader, clock) -> tuple:
    """The mode's runner over its warm-up, measured and (where --profile names the mode) profiled steps: (ZeRO state,
    dtype, compiled and never fallen back to eager, this rank's parameter bytes, (graphs compiled, graph breaks))."""
    profiled = mode in args.profile
    profile = Profile(world.device, args.warmup + args.steps) if profiled and world.rank == 0 else None
    total = args.warmup + args.steps + (PROFILED_STEPS if profiled else 0)  # profiled after the measured
    clock.after_tick, graphs = profile.tick if profile else None, graphs_made()
    runner = run_fsdp2 if mode == "fsdp2" else run_torch if mode in TORCH_MODES else run_app
    try:
        with EagerFallbacks() as fallbacks:
            zero, dtype, compiled, held = runner(mode, args, world, work, loader, clock, total)
    finally:
        if profile:  # a mode that failed inside its recorded step records no further
            profile.stop()
    graphs = tuple(after - before for after, before in zip(graphs_made(), graphs))
    if profile:
        try:
            print(profile.write(args.output_dir / f"profile-{mode}.txt", mode, graphs), flush=True)
        except Exception as e:  # noqa: BLE001 (the profile is an aside: the mode's figures still count)
            print(f"profile {mode}: not written ({type(e).__name__}: {e})", flush=True)
    return zero, dtype, bool(compiled) and not fallbacks.model_frames, held, graphs


def _start_mode(mode, world, threads: int):
    """Start a mode as if in its own process: its threads, an empty compile cache (no recompile limit carried
    over), torch's TF32 defaults (the mode then sets TF32 as the app would), a fresh memory peak; a line where an
    engine of an earlier mode is still alive."""
    torch.set_num_threads(threads)
    torch_private.dynamo_reset()
    torch_private.default_recompiles()  # an app mode before may have raised them for its ZeRO-3 blocks
    if world.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True
    metrics.reset_peak_memory(world.device)  # the host's peak too (offload holds its states there)
    kept = still_held()
    if kept:
        dist.print0(f"held {mode}: the engine of {', '.join(kept)} is still alive (a reference forget_engines does "
                    f"not clear); this mode's peak memory includes it")
    dist.barrier()


def _each_rank(world, value: float) -> list:
    """value of every rank, in rank order."""
    mine = [0.0] * world.world_size
    mine[world.rank] = value
    return dist.host_sum(mine)


class EagerFallbacks(logging.Handler):
    """Collects the frames of the model that torch.compile gave up on during a mode (its recompile limit), so a
    mode that ran eager is not reported compiled; DeepSpeed's own hooks do not count. A frame is judged by where
    its function lives, not by its reason: a block whose guard failed inside DeepSpeed's linear is the model's."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.model_frames = []

    def emit(self, record):
        text = record.getMessage()
        frame = text.splitlines()[1].strip() if "\n" in text else text
        if "recompile_limit" in text and "deepspeed" not in frame:
            self.model_frames.append(frame)

    def __enter__(self):
        logging.getLogger(torch_private.DYNAMO_LOGGER).addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger(torch_private.DYNAMO_LOGGER).removeHandler(self)
