"""Benchmark the app's training step under each ds_config against raw PyTorch, DDP and DataParallel, side by side.

`python -m app.bench` measures every mode in one invocation: it spawns its own ranks (TCP rendezvous on
127.0.0.1), one process group per world size, and runs the modes of that size one after another in it.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from app import config, data, distributed, loop, metrics, models
from app.errors import UserError

TORCH_MODES = ("raw", "raw-compile", "raw-1thread", "ddp", "dataparallel")
FIELDS = ("mode", "ranks", "threads_per_rank", "micro_batch", "global_batch", "dtype", "compiled", "step_time_s",
          "samples_per_s", "tokens_per_s", "ratio_to_raw", "ratio_to_torch", "speed_vs_raw_compile", "mfu",
          "peak_flops", "mfu_datasheet", "datasheet_flops", "data_wait_share", "time_to_first_step_s",
          "peak_memory_bytes", "scaling_efficiency", "zero_state")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
COMPILE_SUFFIX = {"on": "compile", "off": "eager", "auto": "auto"}  # app mode names: zero1+compile, zero1+eager


def parse(argv=None):
    """The benchmark's flags, checked; a mistake is a UserError."""
    parser = argparse.ArgumentParser(prog="python -m app.bench", description=__doc__)
    parser.add_argument("--model", default="cnn", help="cnn, mlp or a transformers preset such as gpt2-tiny")
    parser.add_argument("--batch", type=int, default=0,
                        help="global batch, the same for every mode (default: 16 for text models, 32 otherwise)")
    parser.add_argument("--seq_len", type=int, default=128, help="tokens per sample for text models")
    parser.add_argument("--steps", type=int, default=30, help="measured optimizer steps per mode (median taken)")
    parser.add_argument("--warmup", type=int, default=5, help="steps run before measuring")
    parser.add_argument("--modes", default=",".join(TORCH_MODES + ("app",)),
                        help="comma list of raw, raw-compile, raw-1thread, ddp, dataparallel, app (default: all)")
    parser.add_argument("--configs", default="dp,zero1,zero2,zero3", help="ds_configs/ names the app mode runs")
    parser.add_argument("--compile", default="auto",
                        help="comma list of auto, on, off: the app modes run once per entry (name+compile when on)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"),
                        help="autocast dtype of the torch modes (auto: bf16 on a CUDA device that has it, else fp32)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the multi-rank modes")
    parser.add_argument("--output_dir", default="", help="where bench.json and bench.png go")
    parser.add_argument("--quick", action="store_true", help="3 steps after 1 warm-up, short matmul probe (tests)")
    args = parser.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = set(args.modes) - set(TORCH_MODES + ("app",))
    if unknown:
        raise UserError(f"--modes: unknown mode {sorted(unknown)[0]!r}; choose from {', '.join(TORCH_MODES)}, app")
    args.compile = [c for c in args.compile.split(",") if c]
    if not args.compile or set(args.compile) - {"auto", "on", "off"}:
        raise UserError(f"--compile takes a comma list of auto, on, off; got {','.join(args.compile)!r}")
    if args.dtype == "auto":
        args.dtype = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
    if args.quick:
        args.steps, args.warmup = 3, 1
    if min(args.steps, args.seq_len, args.ranks) < 1 or args.warmup < 0 or args.batch < 0:
        raise UserError("--steps, --seq_len and --ranks must be at least 1, --warmup and --batch 0 or more")
    args.configs = {name: config.load_ds_config(config.REPO / "ds_configs" / f"{name}.json")
                    for name in args.configs.split(",") if name and "app" in args.modes}
    args.spec = models.hf_spec(args.model)
    args.batch = args.batch or (16 if args.spec is not None else 32)
    if args.batch % args.ranks:
        raise UserError(f"--batch {args.batch} is not divisible by --ranks {args.ranks}; each rank takes an equal share")
    args.output_dir = Path(args.output_dir or f"runs/bench-{args.model}-{time.strftime('%Y%m%d-%H%M%S')}")
    return args


def build_data(args):
    """(train set, DataInfo): random token blocks for text models (as many as the run uses), else the dataset."""
    if args.spec is None:
        return data.build_datasets("digits", "data")[::2]
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(models.vocab_size(args.spec.config), (args.batch * (args.steps + args.warmup + 1), args.seq_len),
                           generator=gen)
    info = data.DataInfo(0, task="causal_lm", vocab_size=models.vocab_size(args.spec.config), seq_len=args.seq_len)
    return torch.utils.data.TensorDataset(blocks, blocks), info


def build_model(args, info, ds_config=None):
    """The model every mode trains, from the same seed."""
    torch.manual_seed(0)
    from app.text import byte_tokenizer
    return models.build_model(args.model, info, args.spec, byte_tokenizer() if args.spec else None, ds_config)


def flops_per_sample(args, model, info) -> float:
    """Training FLOPs per sample: the app's formula for text models, else counted on one forward and backward."""
    if info.seq_len:
        return models.train_flops_per_token(model, info.seq_len) * info.seq_len
    from torch.utils.flop_counter import FlopCounterMode
    x = torch.randn(2, info.in_channels, info.image_size, info.image_size)
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / 2


class Clock:
    """Time at the end of each optimizer step, and the time each step waited for its batch."""

    def __init__(self, device):
        self.device, self.ends, self.waits = device, [], []

    def tick(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.ends.append(time.perf_counter())


class TimedLoader:
    """A loader whose next() time goes on the clock; endless when `endless` (for the raw loops)."""

    def __init__(self, loader, clock, endless=False):
        self.loader, self.clock, self.endless = loader, clock, endless
        self.batch_sampler = loader.batch_sampler

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        epoch = 0
        while True:
            it = iter(self.loader)
            while True:
                start = time.perf_counter()
                batch = next(it, None)
                self.clock.waits.append(time.perf_counter() - start)
                if batch is None:
                    break
                yield batch
            if not self.endless:
                return
            epoch += 1
            self.batch_sampler.set_epoch(epoch)


class StepLog:
    """What fit() logs to; here it only marks the end of each optimizer step on the clock."""

    def __init__(self, clock):
        self.clock = clock

    def advance(self, steps):
        self.clock.tick()

    def write_row(self, row):
        pass

    def message(self, text):
        pass


def mean_loss(logits, y):
    """Mean cross entropy; next-token prediction for language models, as transformers' own loss computes it."""
    if logits.dim() == 3:
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), y[:, 1:].reshape(-1))
    return F.cross_entropy(logits.float(), y)


def run_torch(mode, args, world, train_set, info, loader, clock, total):
    """A hand-written PyTorch loop: the plain model (DDP / DataParallel wrapped), torch AdamW, clipping, autocast
    in --dtype; raw-compile adds torch.compile of model and loss and the fused AdamW, PyTorch at its best."""
    model = build_model(args, info).to(world.device)
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif mode == "dataparallel":
        model = torch.nn.DataParallel(model)
    reference = next(iter(args.configs.values()), None) or config.load_ds_config(config.DEFAULT_DS_CONFIG)
    params = {k: v for k, v in reference["optimizer"]["params"].items() if k not in ("torch_adam", "fused")}
    compiled = mode == "raw-compile"
    optimizer = torch.optim.AdamW(model.parameters(), **params, **({"fused": True} if compiled else {}))
    forward, loss_fn = (torch.compile(model, dynamic=False), torch.compile(mean_loss, dynamic=False)) \
        if compiled else (model, mean_loss)
    clip = reference.get("gradient_clipping", 0.0)
    batches = iter(TimedLoader(loader, clock, endless=True))
    dtype = DTYPES[args.dtype]
    model.train()
    for _ in range(total):
        x, y, _ = next(batches)
        x, y = x.to(world.device, non_blocking=True), y.to(world.device, non_blocking=True)
        with torch.autocast(world.device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = loss_fn(forward(x), y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.tick()
    return None, DTYPES[args.dtype], compiled


def run_app(mode, args, world, train_set, info, loader, clock, total):
    """The app's own path: build_model, build_engine with the real ds_config, fit(); returns (the ZeRO state,
    dtype, compiled)."""
    name, _, suffix = mode.partition("+")
    choice = {label: choice for choice, label in COMPILE_SUFFIX.items()}.get(suffix, "auto")
    ds = config.resolve_batch_sizes({**args.configs[name], "train_micro_batch_size_per_gpu": loader.batch_sampler.
                                    batch_size, "gradient_accumulation_steps": 1}, world.world_size, name)
    engine = loop.build_engine(build_model(args, info, ds), config.fill_scheduler_length(ds, total))
    eval_loader = data.build_loader(torch.utils.data.Subset(train_set, range(world.world_size)), 1, world.rank,
                                    world.world_size, False, 0)
    settings = SimpleNamespace(log_interval=10, eval_interval=total, save_interval=0, compile=choice)
    state = {}
    real_step = engine.optimizer.step

    def step_and_measure(*a, **kw):  # gradients exist only inside a step; the optimizer state from step 2
        if engine.global_steps == 1:
            state.update(zero_state(engine, name))
        return real_step(*a, **kw)
    engine.optimizer.step = step_and_measure
    loop.fit(engine, TimedLoader(loader, clock), eval_loader, settings, StepLog(clock), total)
    return state or None, loop.input_dtype(engine), engine.is_compiled


def _storages(tensors) -> dict:
    """Bytes of each distinct storage behind tensors, by address (views of one flat buffer count once)."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in tensors if isinstance(t, torch.Tensor) and t.numel()}


def zero_state(engine, name) -> dict:
    """Per-rank bytes of parameters, gradients and optimizer state, read from the engine's tensors, beside
    the ZeRO paper's formula adapted to fp32 (params 4, grads 4, Adam moments 8 bytes per parameter)."""
    stage, n = engine.zero_optimization_stage(), distributed.world_size()
    optimizer, module_params = engine.optimizer, list(engine.module.parameters())
    psi = sum(getattr(p, "ds_numel", p.numel()) for p in module_params)
    params = _storages(p.ds_tensor if stage == 3 else p for p in module_params)
    if stage == 0:
        grads = _storages(p.grad for p in module_params)
    elif stage == 3:
        grads = _storages([optimizer.grad_partitions_flat_buffer])
    else:
        grads = _storages(g for group in optimizer.averaged_gradients.values() for g in group)
    inner = getattr(optimizer, "optimizer", optimizer)
    moments = _storages(t for state in inner.state.values() for t in state.values())
    # DeepSpeed's ZeRO optimizers keep an fp32 master partition even when training in fp32
    masters = getattr(optimizer, "single_partition_of_fp32_groups", None) or \
        getattr(optimizer, "fp32_partitioned_groups_flat", [])
    master = {k: v for k, v in _storages(masters).items() if k not in params}
    shares = (4 / n if stage >= 3 else 4, 4 / n if stage >= 2 else 4, 8 / n if stage >= 1 else 8)
    formula = sum(shares) * psi
    held = {"params_bytes": params, "grads_bytes": grads, "optimizer_bytes": moments, "master_copy_bytes": master}
    held = {key: sum(value.values()) for key, value in held.items()}
    measured = sum(held.values())
    return {"config": name, "stage": stage, "parameters": psi, **held, "measured_bytes": measured,
            "formula_bytes": int(formula), "measured_over_formula": measured / formula,
            "without_master_over_formula": (measured - held["master_copy_bytes"]) / formula}


def measure(mode, args, world, threads, per_rank_batch, train_set, info) -> dict:
    """Run one mode for warm-up + measured steps on every rank of this group; the reduced fields (rank 0 uses them)."""
    torch.set_num_threads(threads)
    metrics.reset_peak_memory(world.device)
    distributed.barrier()
    started = time.perf_counter()
    clock = Clock(world.device)
    loader = data.build_loader(train_set, per_rank_batch, world.rank, world.world_size, True, 0)
    total = args.warmup + args.steps
    runner = run_torch if mode in TORCH_MODES else run_app
    zero, dtype, compiled = runner(mode, args, world, train_set, info, loader, clock, total)
    ends = [started] + clock.ends
    times = [b - a for a, b in zip(ends, ends[1:])][args.warmup:]
    wait_share = sum(clock.waits[args.warmup:total]) / sum(times)
    distributed.barrier()  # every rank probes the matmul rate at once, as they shared the machine while training
    peak = metrics.matmul_flops(world.device, dtype, 0.1 if args.quick else 0.5)  # in the mode's own dtype
    datasheet = metrics.datasheet_flops(world.device, dtype)
    mine = torch.tensor([statistics.median(times), wait_share, clock.ends[0] - started], dtype=torch.float64)
    step_time, wait_share, first_step = distributed.all_reduce_max(mine).tolist()  # the slowest rank's
    peak = distributed.all_reduce_sum(torch.tensor([peak], dtype=torch.float64)).item()
    memory = torch.zeros(world.world_size, dtype=torch.float64)
    memory[world.rank] = metrics.peak_memory_bytes(world.device)
    memory = distributed.all_reduce_sum(memory)
    global_batch = per_rank_batch * world.world_size
    samples_per_s = global_batch / step_time
    datasheet = datasheet and datasheet * world.world_size
    return {"mode": mode, "ranks": world.world_size, "threads_per_rank": threads,
            "micro_batch": per_rank_batch, "global_batch": global_batch, "dtype": str(dtype)[6:],
            "compiled": bool(compiled), "step_time_s": step_time,
            "samples_per_s": samples_per_s, "tokens_per_s": samples_per_s * info.seq_len if info.seq_len else None,
            "mfu": samples_per_s * args.flops_per_sample / peak, "peak_flops": peak,
            "mfu_datasheet": datasheet and samples_per_s * args.flops_per_sample / datasheet,
            "datasheet_flops": datasheet,
            "data_wait_share": wait_share, "time_to_first_step_s": first_step,
            "peak_memory_bytes": [int(m) for m in memory.tolist()], "zero_state": zero}


def plan(args, cores: int, gpus: int) -> tuple:
    """{world size: [(mode, threads, per-rank batch)]} and [(mode, why it is skipped)]."""
    groups, skipped = {1: [], args.ranks: []}, []
    threads = lambda ranks: 1 if gpus else max(1, cores // ranks)  # noqa: E731 (ranks share the node's cores)
    for mode in ("raw", "raw-compile"):
        if mode in args.modes:
            groups[1].append((mode, threads(1), args.batch))
    if "raw-1thread" in args.modes:  # the reference for scaling: one rank's share of the batch on one thread
        groups[1].append(("raw-1thread", 1, args.batch // args.ranks))
    if "dataparallel" in args.modes:
        if gpus > 1:
            groups[1].append(("dataparallel", threads(1), args.batch))
        else:
            skipped.append(("dataparallel", f"needs more than one GPU, this machine has {gpus}"))
    multi = args.ranks > 1 and (not torch.cuda.is_available() or gpus >= args.ranks)
    if args.ranks > 1 and not multi:
        skipped.append((f"{args.ranks}-rank modes", f"need {args.ranks} GPUs, this machine has {gpus}"))
    if "ddp" in args.modes and multi:
        groups[args.ranks].append(("ddp", threads(args.ranks), args.batch // args.ranks))
    for name in args.configs:
        for choice in args.compile:
            mode = f"{name}+{COMPILE_SUFFIX[choice]}" if len(args.compile) > 1 or choice != "auto" else name
            groups[1].append((mode, threads(1), args.batch))
            if multi:
                groups[args.ranks].append((mode, threads(args.ranks), args.batch // args.ranks))
    return {ranks: jobs for ranks, jobs in groups.items() if jobs}, skipped


def _worker(rank, world_size, port, jobs, args, results):
    """One rank of a group: join it, then measure its modes one after another; rank 0 writes the results."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    distributed.prepare_environment()
    world = distributed.setup(timeout_s=600)
    try:
        train_set, info = build_data(args)
        rows = [measure(mode, args, world, threads, batch, train_set, info) for mode, threads, batch in jobs]
        if world.rank == 0:
            Path(results).write_text(json.dumps(rows))
    finally:
        distributed.teardown()


def run_groups(groups: dict, args) -> list:
    """Every group's rows, each group in fresh processes (spawned, not forked: no torch threads inherited)."""
    import torch.multiprocessing as mp
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world_size, jobs in groups.items():
            results = Path(tmp) / f"{world_size}.json"
            mp.start_processes(_worker, args=(world_size, distributed.free_port(), jobs, args, str(results)),
                               nprocs=world_size, join=True, start_method="spawn")
            rows += json.loads(results.read_text())
    return rows


def add_ratios(rows: list):
    """Step time against the raw loop and against torch at the same world size; weak-scaling efficiency."""
    by_mode = {(r["mode"], r["ranks"]): r for r in rows}
    raw, one_thread = by_mode.get(("raw", 1)), by_mode.get(("raw-1thread", 1))
    best = by_mode.get(("raw-compile", 1))
    for r in rows:
        r["speed_vs_raw_compile"] = best["step_time_s"] / r["step_time_s"] if best and r["ranks"] == 1 else None
        torch_ref = raw if r["ranks"] == 1 else by_mode.get(("ddp", r["ranks"]))
        r["ratio_to_raw"] = r["step_time_s"] / raw["step_time_s"] if raw else None
        r["ratio_to_torch"] = r["step_time_s"] / torch_ref["step_time_s"] if torch_ref else None
        r["scaling_efficiency"] = r["samples_per_s"] / (r["ranks"] * one_thread["samples_per_s"]) \
            if one_thread and r["ranks"] > 1 else None


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def table(rows: list) -> str:
    """The rows as a fixed-width text table."""
    rate = "tokens/s" if rows[0]["tokens_per_s"] is not None else "samples/s"
    lines = [f"{'mode':<16}{'ranks':>6}{'thr':>4}{'batch':>6}{'dtype':>9}{'step ms':>9}{rate:>11}{'vs raw':>8}"
             f"{'vs torch':>9}{'speed/rc':>9}{'MFU':>6}{'MFU ds':>7}{'wait':>7}{'first s':>8}{'peak MB':>9}"
             f"{'scale':>7}{'ZeRO/formula':>13}"]
    for r in rows:
        zero = r["zero_state"]
        lines.append(
            f"{r['mode']:<16}{r['ranks']:>6}{r['threads_per_rank']:>4}{r['micro_batch']:>6}{r['dtype']:>9}"
            f"{r['step_time_s'] * 1e3:>9.1f}{r['tokens_per_s'] or r['samples_per_s']:>11.0f}"
            f"{_fmt(r['ratio_to_raw'], '.3f'):>8}{_fmt(r['ratio_to_torch'], '.3f'):>9}"
            f"{_fmt(r['speed_vs_raw_compile'], '.3f'):>9}{r['mfu']:>6.2f}{_fmt(r['mfu_datasheet'], '.2f'):>7}"
            f"{r['data_wait_share']:>7.1%}{r['time_to_first_step_s']:>8.2f}{max(r['peak_memory_bytes']) / 2**20:>9.0f}"
            f"{_fmt(r['scaling_efficiency'], '.3f'):>7}{_fmt(zero and zero['measured_over_formula'], '.3f'):>13}")
    return "\n".join(lines)


def headline(rows: list) -> str:
    """The app's speed over raw PyTorch + torch.compile + fused AdamW at one rank, mode by mode."""
    app = [r for r in rows if r["speed_vs_raw_compile"] is not None and r["mode"] not in TORCH_MODES]
    if not app:
        return "headline: needs the raw-compile mode and an app mode at 1 rank"
    return "headline (app speed / raw PyTorch + compile + fused AdamW, 1 rank): " + ", ".join(
        f"{r['mode']} {r['speed_vs_raw_compile']:.3f}" for r in app)


def plot(rows: list, path: Path):
    """Bars of throughput and of the largest rank's peak memory, one per mode."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [f"{r['mode']} x{r['ranks']}" for r in rows]
    rate = "tokens_per_s" if rows[0]["tokens_per_s"] is not None else "samples_per_s"
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6, len(rows) * 0.8), 7), sharex=True)
    top.bar(labels, [r[rate] for r in rows], color="tab:blue")
    top.set_ylabel(rate.replace("_per_s", "/s"))
    bottom.bar(labels, [max(r["peak_memory_bytes"]) / 2**20 for r in rows], color="tab:orange")
    bottom.set_ylabel("peak memory per rank (MiB)")
    bottom.tick_params(axis="x", rotation=45)
    for ax in (top, bottom):
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    """Measure every mode, then print the table and write bench.json and bench.png; returns the exit code."""
    distributed.prepare_environment()
    try:
        args = parse(argv)
        train_set, info = build_data(args)
        model = build_model(args, info)
        args.flops_per_sample = flops_per_sample(args, model, info)
        groups, skipped = plan(args, os.cpu_count() or 1, torch.cuda.device_count())
        if not groups:
            raise UserError("nothing to measure: --modes and --configs select no mode this machine can run")
        args.output_dir.mkdir(parents=True, exist_ok=True)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    rows = run_groups(groups, args)
    add_ratios(rows)
    rows = [{key: r[key] for key in FIELDS} for r in rows]
    result = {"command": " ".join(["python -m app.bench", *(argv if argv is not None else sys.argv[1:])]),
              "model": args.model, "parameters": sum(p.numel() for p in model.parameters()),
              "seq_len": info.seq_len or None, "global_batch": args.batch, "steps": args.steps,
              "warmup": args.warmup, "flops_per_sample": args.flops_per_sample, "torch_dtype": args.dtype,
              "device": "cuda" if torch.cuda.is_available() else "cpu", "cpu_count": os.cpu_count(),
              "torch": torch.__version__, "modes": rows, "skipped": [{"mode": m, "why": why} for m, why in skipped]}
    (args.output_dir / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, args.output_dir / "bench.png")
    print(table(rows))
    print(headline(rows))
    for mode, why in skipped:
        print(f"skipped {mode}: {why}")
    print(f"wrote {args.output_dir / 'bench.json'} and {args.output_dir / 'bench.png'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
