"""Benchmark the app's training step under each ds_config against raw PyTorch, DDP and DataParallel, side by side.

`python -m app.tools.bench` measures every mode in one invocation: it spawns its own ranks (TCP rendezvous on
127.0.0.1), one process group per world size, and runs the modes of that size one after another in it.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from app.distributed import dist
from app.ds import accelerate_file, auto as ds_auto, config as ds_config, precision
from app.distributed import launch
from app.parallel import layout
from app.core import lora, resolver
from app.settings import Settings
from app.errors import UserError, first_line, report
from app.observe import metrics
from app.tools.bench_plan import add_planned_peaks
from app.tools.bench_common import counted_model
from app.tools.bench_modes import COMPILE_SUFFIX, LORA, build_workload, forget_engines, measure
from app.tools.bench_report import TORCH_MODES, adapters, add_ratios, checkpointing, headline, headline_vs_fsdp2, \
    plot, splitting, table

FIELDS = ("mode", "ranks", "threads_per_rank", "micro_batch", "global_batch", "dtype", "compiled", "pipeline_stages",
          "tensor_parallel", "activation_checkpointing", "step_time_s", "samples_per_s", "tokens_per_s", "ratio_to_raw",
          "ratio_to_torch", "speed_vs_raw_compile", "speed_vs_fsdp2", "speed_vs_one_device", "mfu", "peak_flops",
          "mfu_datasheet", "datasheet_flops", "data_wait_share", "time_to_first_step_s", "peak_memory_bytes",
          "param_bytes", "scaling_efficiency", "zero_state", "plan_peak_bytes", "plan_over_peak", "plan_host_bytes",
          "host_peak_bytes", "graphs")
SETUP = "bench-args.json"  # in the output folder: what app.tools.bench_replan reads


def parse(argv=None):
    """The benchmark's flags, checked; a mistake is a UserError."""
    parser = argparse.ArgumentParser(prog="python -m app.tools.bench", description=__doc__)
    parser.add_argument("--model", default="cnn", help="cnn, mlp, a torchvision classifier such as resnet50 (on "
                        "3x32x32 synthetic images), a transformers preset such as gpt2-tiny or llama-tiny, or a "
                        "save_pretrained folder (on random tokens)")
    parser.add_argument("--batch", type=int, default=0,
                        help="global batch, the same for every mode (default: 16 for text models, 32 otherwise)")
    parser.add_argument("--seq_len", type=int, default=128, help="tokens per sample for text models")
    parser.add_argument("--steps", type=int, default=30, help="measured optimizer steps per mode (median taken)")
    parser.add_argument("--warmup", type=int, default=5, help="steps run before measuring")
    parser.add_argument("--modes", default=",".join(TORCH_MODES + ("app",)),
                        help="comma list of raw, raw-compile, raw-1thread, ddp, dataparallel, fsdp2 (torch's FSDP2, the "
                        "peer of ZeRO-3, on 1 and --ranks ranks), app (default: all)")
    parser.add_argument("--configs", default="dp,zero1,zero2,zero3",
                        help="ds_configs/ names the app mode runs (pipeline and tensor_parallel split the model), or paths "
                        "of JSON or accelerate YAML files (name.json: the mode is named name)")
    parser.add_argument("--compile", default="auto",
                        help="comma list of auto, on, off: the app modes run once per entry (name+compile when on)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"),
                        help="autocast dtype of the torch modes (auto: bf16 on a CUDA device that has it, else fp32)")
    parser.add_argument("--lora", nargs="?", const="both", default="",
                        help="transformers models: run each app mode twice, training the whole model and LoRA "
                        "adapters on it (mode+lora), and compare the two; --lora only: the LoRA runs alone (a model "
                        "too large to train whole on the machine)")
    parser.add_argument("--profile", default="", help="comma list of modes whose step torch's profiler records, "
                        "after the measured steps: output_dir/profile-<mode>.txt")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the multi-rank modes")
    parser.add_argument("--output_dir", default="", help="where bench.json and bench.png go")
    parser.add_argument("--plan", default="on", choices=("on", "off"),
                        help="the memory plan's peak beside each app mode's (off: none; python -m "
                        "app.tools.bench_replan OUTPUT_DIR plans the rows later, on any machine)")
    parser.add_argument("--quick", action="store_true", help="3 steps after 1 warm-up, short matmul probe (tests)")
    return _checked(parser.parse_args(argv))


def _checked(args):
    """The parsed flags made usable: lists split, dtype and batch resolved, ds_configs loaded; or a UserError."""
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = set(args.modes) - set(TORCH_MODES + ("app",))
    if unknown:
        raise UserError(f"--modes: unknown mode {sorted(unknown)[0]!r}; choose from {', '.join(TORCH_MODES)}, app")
    args.compile = [c for c in args.compile.split(",") if c]
    args.profile = [m for m in args.profile.split(",") if m]
    if args.lora not in ("", "both", "only"):
        raise UserError(f"--lora takes nothing (= both), both or only; got {args.lora!r}")
    if not args.compile or set(args.compile) - {"auto", "on", "off"}:
        raise UserError(f"--compile takes a comma list of auto, on, off; got {','.join(args.compile)!r}")
    if args.dtype == "auto":
        args.dtype = "bf16" if torch.cuda.is_available() and precision.bf16_runs(torch.cuda.get_device_capability()) \
            else "fp32"  # the app's rule: bf16 where it runs natively (torch's own check says yes to emulation)
    if args.quick:
        args.steps, args.warmup = 3, 1
    if min(args.steps, args.seq_len, args.ranks) < 1 or args.warmup < 0 or args.batch < 0:
        raise UserError("--steps, --seq_len and --ranks must be at least 1, --warmup and --batch 0 or more")
    args.configs = {_config_path(name).stem: ds_config.load_ds_config(_config_path(name))
                    for name in args.configs.split(",") if name and "app" in args.modes}
    task = resolver.build(Settings(model=args.model, lora=bool(args.lora)))
    # the torch modes' optimizer and clipping, read here: in a rank, DeepSpeed's check would count its world size;
    # filled as a run fills it (an accelerate file names no optimizer and leaves the clipping "auto")
    first = next(iter(args.configs.values()), None) or ds_config.load_ds_config(ds_config.DEFAULT_DS_CONFIG)
    args.reference = ds_auto.fill(first, resolver.auto_facts(task.spec), 1)[0]
    args.batch = args.batch or task.bench_batch  # as train.py
    if args.batch % args.ranks:
        raise UserError(f"--batch {args.batch} is not divisible by --ranks {args.ranks}; each rank takes an equal share")
    args.output_dir = Path(args.output_dir or f"runs/bench-{args.model}-{time.strftime('%Y%m%d-%H%M%S')}")
    return args


def _check_profiled(profiled: list, groups: dict):
    """A UserError when --profile names a mode that will not run."""
    modes = sorted({mode for jobs in groups.values() for mode, _, _ in jobs})
    unknown = [m for m in profiled if m not in modes]
    if unknown:
        raise UserError(f"--profile: no mode {unknown[0]!r} runs here; the modes are {', '.join(modes)}")


def _config_path(name: str) -> Path:
    """A --configs entry: a ds_configs/ name, or the path of a JSON file of one's own or an accelerate config file
    (its stem names the mode)."""
    own = Path(name).suffix.lower() in (".json", *accelerate_file.SUFFIXES)
    return Path(name) if own else ds_config.REPO / "ds_configs" / f"{name}.json"


def group_modes(args, cores: int, gpus: int) -> tuple:
    """{world size: [(mode, threads, per-rank batch)]} and [(mode, why it is skipped)]."""
    groups, skipped = {1: [], args.ranks: []}, []
    threads = lambda ranks: max(1, cores // ranks)  # noqa: E731 (the node's cores shared, on a GPU too: CPU Adam)
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
    if "fsdp2" in args.modes:  # on the world sizes of the app modes, which it is compared with
        for ranks in sorted({1, args.ranks} if multi else {1}):
            groups[ranks].append(("fsdp2", threads(ranks), args.batch // ranks))
    for name, ds in args.configs.items():
        for choice in args.compile:
            plain = f"{name}+{COMPILE_SUFFIX[choice]}" if len(args.compile) > 1 or choice != "auto" else name
            runs = {"both": [plain, plain + LORA], "only": [plain + LORA]}.get(args.lora, [plain])
            for mode, ranks in [(m, r) for m in runs for r in sorted({1, args.ranks} if multi else {1})]:
                try:  # a config that splits the model runs only where the ranks hold the split
                    laid = layout.rank_layout(ds, ranks, 0, name)
                    lora.check_layout(mode.endswith(LORA), laid)
                    replicas = laid.replicas
                except UserError as e:
                    skipped.append((f"{mode} x{ranks}", str(e)))
                    continue
                if args.batch % replicas:
                    skipped.append((f"{mode} x{ranks}", f"--batch {args.batch} does not divide among {replicas} "
                                                        f"data-parallel replicas"))
                    continue
                groups[ranks].append((mode, threads(ranks), args.batch // replicas))
    return {ranks: jobs for ranks, jobs in groups.items() if jobs}, skipped


def _worker(rank, world_size, port, jobs, args, results):
    """One rank of a group: join it, then measure its modes one after another; rank 0 writes the results."""
    os.environ.update(launch.rank_env(rank, world_size, port))
    launch.prepare_environment()
    world = launch.setup(timeout_s=600)
    try:
        work, rows = build_workload(args), []
        for mode, threads, batch in jobs:
            rows.append(_measured(mode, args, world, threads, batch, work))
            if world.rank == 0:  # kept as each mode ends: a group cut short still reports the modes it measured
                Path(results).write_text(json.dumps(rows))
    finally:
        dist.teardown()


def _measured(mode, args, world, threads, batch, work) -> dict:
    """measure()'s row; on one rank a mode that fails (out of memory, a compiler error) is a row that says why and
    the next mode runs (on several ranks the others may wait in a collective of the failed step: the group ends)."""
    try:
        row = measure(mode, args, world, threads, batch, work)
    except Exception as e:  # noqa: BLE001 (said in the row, the benchmark goes on)
        if world.world_size > 1:
            raise
        row = {"mode": mode, "ranks": 1, "failed": f"{type(e).__name__}: {first_line(e)[:300]}"}
    if "failed" in row:  # out of the except block: its traceback, and the frames holding the mode, are gone
        forget_engines()
        metrics.reset_peak_memory(world.device)  # what the failed mode held goes back to the allocator
    dist.print0(f"measured {mode} x{world.world_size}: " + (f"failed, {row['failed']}" if "failed" in row else
                f"{row['step_time_s'] * 1e3:.1f} ms a step, {row['tokens_per_s'] or row['samples_per_s']:.0f} "
                f"{'tokens' if row['tokens_per_s'] else 'samples'}/s, peak {max(row['peak_memory_bytes']) / 2**20:.0f}"
                f" MB, {row['graphs'][0]} graphs"))
    return row


def run_groups(groups: dict, args) -> list:
    """Every group's rows, each group in fresh processes (spawned, not forked: no torch threads inherited)."""
    import torch.multiprocessing as mp
    rows = []
    for world_size, jobs in groups.items():
        results = args.output_dir / f"rows-{world_size}-ranks.json"  # each mode's row as it ends
        results.unlink(missing_ok=True)
        try:
            mp.start_processes(_worker, args=(world_size, launch.free_port(), jobs, args, str(results)),
                               nprocs=world_size, join=True, start_method="spawn")
        except Exception as e:  # noqa: BLE001 (a rank died: the modes measured before it still count)
            rows.append({"mode": f"{world_size}-rank group", "ranks": world_size, "failed": first_line(e)[:300]})
        rows += json.loads(results.read_text()) if results.is_file() else []
    return rows


def main(argv=None) -> int:
    """Measure every mode, then print the table and write bench.json and bench.png; returns the exit code."""
    launch.prepare_environment()
    try:
        args = parse(argv)
        work = build_workload(args)
        model = counted_model(work)
        args.flops_per_sample = work.task.flops_per_sample(model, work.info)
        args.lora_flops_per_sample = bool(args.lora) and work.task.flops_per_sample(counted_model(work, lora=True),
                                                                                     work.info)
        groups, skipped = group_modes(args, os.cpu_count() or 1, torch.cuda.device_count())
        if not groups:
            raise UserError("nothing to measure: --modes and --configs select no mode this machine can run")
        _check_profiled(args.profile, groups)
        args.output_dir.mkdir(parents=True, exist_ok=True)
    except UserError as e:
        return report(e)
    argv = list(map(str, argv if argv is not None else sys.argv[1:]))
    write_setup(args.output_dir, argv, args.configs)
    rows = run_groups(groups, args)
    failed, rows = [r for r in rows if "failed" in r], [r for r in rows if "failed" not in r]
    add_ratios(rows)
    planned = add_planned_peaks(rows, args.configs if args.plan == "on" else {}, work) if rows else []
    rows = [{key: r[key] for key in FIELDS} for r in rows]
    result = {"command": " ".join(["python -m app.tools.bench", *argv]),
              "model": args.model, "parameters": sum(p.numel() for p in model.parameters()),
              "seq_len": work.info.seq_len or None, "global_batch": args.batch, "steps": args.steps,
              "warmup": args.warmup, "flops_per_sample": args.flops_per_sample, "torch_dtype": args.dtype,
              "device": "cuda" if torch.cuda.is_available() else "cpu", "cpu_count": os.cpu_count(),
              "torch": torch.__version__, "modes": rows, "failed": failed,
              "skipped": [{"mode": m, "why": why} for m, why in skipped]}
    (args.output_dir / "bench.json").write_text(json.dumps(result, indent=2) + "\n")
    if not rows:
        print("\n".join(f"failed {r['mode']} x{r['ranks']}: {r['failed']}" for r in failed))
        return 1
    _print_report(rows, planned, failed, skipped, args.output_dir)
    return 0


def write_setup(output_dir: Path, argv: list, configs: dict):
    """output_dir/bench-args.json: the flags, the device and the configs' dicts, all a plan of the rows needs later
    on another machine (app.tools.bench_replan), however the benchmark ends; the rows of an earlier run there go."""
    for old in output_dir.glob("rows-*-ranks.json"):
        old.unlink()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    (output_dir / SETUP).write_text(json.dumps({"argv": argv, "device": device, "configs": configs}, indent=1) + "\n")


def _print_report(rows: list, planned: list, failed: list, skipped: list, output_dir: Path):
    """The chart in output_dir; the table, the headlines, the comparisons, the plan's lines, what failed and what
    was skipped, printed."""
    plot(rows, output_dir / "bench.png")
    print(table(rows))
    print(headline(rows))
    for line in headline_vs_fsdp2(rows) + splitting(rows) + checkpointing(rows) + adapters(rows) + planned:
        print(line)
    for r in failed:
        print(f"failed {r['mode']} x{r['ranks']}: {r['failed']}")
    for mode, why in skipped:
        print(f"skipped {mode}: {why}")
    print(f"wrote {output_dir / 'bench.json'} and {output_dir / 'bench.png'}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
