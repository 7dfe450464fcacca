"""Will it fit? The memory plan of a model under each ds_config before the run: per rank, the weights, gradients,
optimizer state and fp32 masters on the GPU and on the host, the activations a sample adds (a compiled step's, as a
run on a GPU compiles; --compile off: the eager step's), the predicted peak, the largest micro batch that fits, and
the fastest config that fits. No GPU and no download needed. With --preference, of preference tuning: a sample
is a pair (two sequences) and the reference model is counted. With --grpo, of online RL: a sample is a prompt, its
group of completions sampled (their key-value cache, and under ZeRO-3 the weights gathered whole) then trained on,
seq_len tokens each, prompt and completion. With --sequence_parallel N (DeepSpeed's Ulysses), each rank holds
seq_len / N tokens of every sample and ZeRO partitions over all --world_size ranks.

    python -m app.tools.plan --model gpt2-124m --world_size 8 --micro_batch 16 --gpu_memory 80GB
    python -m app.tools.plan --model llama-1b --seq_len 32768 --sequence_parallel 4 --world_size 4 --gpu_memory 80GB
    python -m app.tools.plan --model llama-1b --grpo --num_generations 8 --seq_len 1024 --gpu_memory 80GB
"""
import argparse
import re
import sys
from pathlib import Path

import torch

from app.ds import auto as ds_auto, config as ds_config, internals as ds_internals
from app.core import lora, preference, resolver
from app.memory import estimate, host, planner
from app.tools.plan_notes import activation_notes, sequence_notes, task_notes
from app.settings import Settings
from app.errors import UserError, report

# Fastest first, with what each costs to save its memory: the recommendation is the first that fits.
ORDER = {"dp": "nothing is partitioned: the least communication",
         "zero1": "partitions the optimizer state and fp32 masters over the ranks, communicating as much as dp",
         "zero2": "partitions the gradients too (a reduce-scatter in place of the all-reduce)",
         "activation_checkpointing": "keeps dp's layout and computes each block's activations twice",
         "zero3": "partitions the weights too, gathering them layer by layer (half as much communication again)",
         "zero2_offload": "moves the optimizer state and its step to the CPU (host memory; slower steps)",
         "zero3_offload": "moves the weights and optimizer state to the CPU (the slowest)"}
NOT_PLANNED = {"bf16": "dp.json with bf16 autocast always: on a GPU, the same as dp",
               "pipeline": "splits the layers over the ranks: its stages' bytes are the bench's parameter bytes",
               "tensor_parallel": "shards each layer over the ranks: its shards' bytes are the bench's parameter bytes",
               "sequence_parallel": "dp.json with each sequence split: plan it with --deepspeed_config"}
KINDS = ("weights", "gradients", "optimizer", "masters", "working")  # the device's columns, in order
UNITS = {"": 1e9, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
         "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def memory_size(text: str, flag: str = "--gpu_memory") -> int:
    """Bytes of '80GB', '80GiB', '81920MiB', '80' (GB)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text or "")
    if not match or match.group(2).lower() not in UNITS or float(match.group(1)) <= 0:
        raise UserError(f"{flag} {text!r} is not a memory size; write it like 80GB, 80GiB or 81920MiB")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m app.tools.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="cnn", help="as train.py takes it: a preset, a torchvision classifier, "
                        "a save_pretrained folder (its config.json is enough) or a hub name")
    parser.add_argument("--deepspeed_config", default="", help="one ds_config (default: every shipped one)")
    parser.add_argument("--world_size", type=int, default=0, help="ranks in all, sequence-parallel ones included "
                        "(default: the GPUs here, at least 1)")
    parser.add_argument("--micro_batch", type=int, default=0, help="samples per rank and micro step (default: "
                        "the config's train_micro_batch_size_per_gpu)")
    parser.add_argument("--seq_len", type=int, default=0, help="text: tokens per sample (default: the model's "
                        "positions, at most 1024; any length given is planned)")
    parser.add_argument("--sequence_parallel", type=int, default=None, help="text: ranks that share each sequence "
                        "(DeepSpeed's Ulysses): each holds seq_len / N tokens (default: --deepspeed_config's "
                        "sequence_parallel_size, else 1)")
    parser.add_argument("--image_size", type=int, default=0,
                        help="images: side in pixels (default: 224 for torchvision models, 8 for cnn and mlp)")
    parser.add_argument("--tiled", default="auto", choices=("auto", "on", "off"), help="transformers models: the "
                        "MLPs and the output layer with the loss by tiles (train.py's --tiled; auto: under SP)")
    parser.add_argument("--compile", default="auto", choices=("auto", "on", "off"), help="train.py's (auto: on)")
    parser.add_argument("--lora", action="store_true", help="transformers models: plan LoRA fine-tuning (train.py's "
                        "--lora): the adapters train, the base model is frozen")
    parser.add_argument("--lora_rank", type=int, default=8, help="LoRA: the adapters' inner size (train.py's)")
    parser.add_argument("--lora_targets", default="all-linear", help="LoRA: the modules with adapters (train.py's)")
    parser.add_argument("--preference", action="store_true", help="causal LMs: plan preference tuning (train.py's "
                        "--task preference): a sample is a pair of answers, two sequences, beside the reference model")
    parser.add_argument("--reference", choices=("live", "precompute"), default=Settings.reference,
                        help="preference: train.py's (precompute: no reference model while training)")
    parser.add_argument("--preference_loss", choices=preference.LOSSES, default=Settings.preference_loss,
                        help="preference: train.py's (simpo: no reference model)")
    parser.add_argument("--grpo", action="store_true", help="causal LMs: plan online RL (train.py's --task grpo)")
    for flag, kind in (("num_generations", int), ("beta", str), ("gather_for_generation", str)):
        parser.add_argument(f"--{flag}", type=kind, default=getattr(Settings, flag), help="grpo: train.py's")
    parser.add_argument("--gpu_memory", default="", help="memory of one GPU, e.g. 80GB (default: this GPU's)")
    parser.add_argument("--host_memory", default="", help="memory of one machine, which holds what its ranks "
                        "offload, e.g. 512GB (default: this machine's, or its cgroup's limit where lower)")
    parser.add_argument("--ranks_per_node", type=int, default=0, help="ranks on each machine, whose offloaded "
                        "states share its memory (default: this machine's GPUs, 8 without one; at most --world_size)")
    return parser


GRPO = ("num_generations", "beta", "gather_for_generation")


def parse(argv=None):
    """The command's flags, checked: a mistake is a UserError."""
    args = _parser().parse_args(argv)
    if not args.preference and (args.reference, args.preference_loss) != (Settings.reference,
                                                                           Settings.preference_loss):
        raise UserError("--reference and --preference_loss plan preference tuning: add --preference")
    if not args.grpo and any(getattr(args, flag) != getattr(Settings, flag) for flag in GRPO):
        raise UserError("--num_generations, --beta and --gather_for_generation plan online RL: add --grpo")
    if args.grpo and args.preference:
        raise UserError("--grpo and --preference plan two kinds of training: pick one")
    if min(args.world_size, args.micro_batch, args.seq_len, args.image_size, args.ranks_per_node) < 0:
        raise UserError("--world_size, --micro_batch, --seq_len, --image_size and --ranks_per_node must be 1 or more")
    if args.gpu_memory:
        args.gpu_memory = memory_size(args.gpu_memory)
    elif torch.cuda.is_available():
        args.gpu_memory = torch.cuda.get_device_properties(0).total_memory
    else:
        raise UserError("no GPU here to read the memory of: pass --gpu_memory, e.g. --gpu_memory 80GB")
    args.world_size = args.world_size or max(1, torch.cuda.device_count())
    args.host_memory = memory_size(args.host_memory, "--host_memory") if args.host_memory else host.host_memory()
    args.ranks_per_node = args.ranks_per_node or min(args.world_size, torch.cuda.device_count() or 8)
    if args.ranks_per_node > args.world_size:
        raise UserError(f"--ranks_per_node {args.ranks_per_node} is more than --world_size {args.world_size}")
    _check_sequence_parallel(args)
    return args


def _check_sequence_parallel(args):
    """--sequence_parallel, else the JSON's sequence_parallel_size (a what-if flag outranks it); a UserError where it
    cannot split the ranks or the sequence evenly."""
    if args.sequence_parallel is None:
        read = ds_config.load_ds_config(Path(args.deepspeed_config), cuda=True, bf16_ok=True, say=lambda line: None) \
            if args.deepspeed_config else {}  # quiet: its warnings are said once, where the configs are read
        args.sequence_parallel = read.get("sequence_parallel_size", 1)
    degree = args.sequence_parallel
    if degree < 1:
        raise UserError(f"--sequence_parallel {degree}: it counts ranks, 1 or more (1: no sequence parallelism)")
    if args.world_size % degree:
        raise UserError(f"--sequence_parallel {degree} does not divide --world_size {args.world_size}: each "
                        f"data-parallel replica is {degree} ranks")
    if args.seq_len % degree:
        raise UserError(f"--sequence_parallel {degree} does not divide --seq_len {args.seq_len}: each rank holds an "
                        f"equal part of every sequence")


BF16 = "+bf16"  # a config's row with DeepSpeed's bf16 section (16-bit weights) in place of its autocast


def configs(args) -> dict:
    """{name: DeepSpeed dict as a GPU with bf16 resolves it} of the configs to plan; each one that takes bf16
    autocast (fp32 weights) is followed by name+bf16, the same with DeepSpeed's bf16 section (16-bit weights)."""
    paths = [Path(args.deepspeed_config)] if args.deepspeed_config else \
        [p for p in (ds_config.REPO / "ds_configs").glob("*.json") if p.stem not in NOT_PLANNED]
    found = {}
    for path in sorted(paths, key=lambda p: list(ORDER).index(p.stem) if p.stem in ORDER else len(ORDER)):
        name = str(path) if args.deepspeed_config else path.stem
        found[name] = ds_config.load_ds_config(path, cuda=True, bf16_ok=True)
        if (found[name].get("torch_autocast") or {}).get("enabled") is True:
            found[name + BF16] = planner.with_bf16_weights(found[name])
    return found


def _stem(name: str) -> str:
    """The shipped config a row plans (zero2 for zero2+bf16)."""
    return Path(name.removesuffix(BF16)).stem


def _speed_rank(name: str) -> tuple:
    """Where a row stands in ORDER, fastest first; autocast before bf16 weights at one config, as precision "auto"
    picks (a config outside ORDER: first)."""
    return (list(ORDER).index(_stem(name)) if _stem(name) in ORDER else -1, name.endswith(BF16))


def task_of(args):
    """The task train.py builds for these flags (LoRA or preference on an image model: the task says no)."""
    task = "preference" if args.preference else "grpo" if args.grpo else "auto"
    same = (*GRPO, "model", "lora", "reference", "preference_loss", "tiled")
    return resolver.build(Settings(task=task, **{flag: getattr(args, flag) for flag in same}))


def measure(args, named: dict, task) -> dict:
    """{name: MemoryPlan} of each config, from the model's shape alone; ZeRO's "auto" values (bucket sizes, ZeRO-3's
    leaf blocks) as a run fills them for this model."""
    adapters = (args.lora_rank, lora.targets_of(args)) if args.lora else None
    work = planner.workload(task, args.seq_len, args.image_size, frozen=args.lora, sequence=args.sequence_parallel)
    facts = resolver.auto_facts(task.spec)
    zero = {name: planner.with_accumulation({**ds, "zero_optimization": ds_auto.fill(ds, facts, args.world_size)[0][
        "zero_optimization"]} if "zero_optimization" in ds else ds, args.world_size // args.sequence_parallel,
        args.micro_batch) for name, ds in named.items()}
    return planner.plans(work, zero, args.world_size, adapters, task.reference_kind == "frozen copy",
                         planner.sampling_of(task, args.seq_len), planner.compiles_under(task, args.compile))


def _gb(count) -> str:
    return "-" if count is None else f"{count / 1e9:,.2f}"


def _heading(args, first, budget: float, reference: str, notes: list, width: int) -> list:
    """The plan's lines above its rows: the model and GPU, notes (sequence_notes, task_notes), the columns (the
    configs' as wide as `width`; the reference's in the table of a run that holds one only)."""
    trained = f" ({first.trained / 1e6:,.2f}M of them LoRA adapters that train)" if first.trained < first.parameters \
        else ""
    degree = args.sequence_parallel
    ranks = f"{args.world_size} data-parallel rank(s)" if degree == 1 else \
        f"{args.world_size} ranks: {args.world_size // degree} data-parallel replica(s) of {degree}"
    return [f"model {args.model}: {first.parameters / 1e6:,.1f}M parameters{trained}; {ranks}; "
            f"GPU {args.gpu_memory / 1e9:,.1f} GB, of which a run may use {budget / 1e9:,.1f}; host "
            f"{args.host_memory / 1e9:,.1f} GB for {args.ranks_per_node} rank(s); in GB per rank",
            *notes,
            f"{'config':<{width}}{'weights':>8}{'grads':>8}{'optim':>8}{'masters':>8}{'working':>8}"
            + (f"{'ref':>8}" if reference else "") + f"{'host':>8}"
            f"{'act/sample':>11}{'micro':>6}{'peak':>9}{'fits':>6}{'largest':>8}{'DS est.':>8}"]


def table(args, named: dict, plans: dict, task, notes: tuple = ()) -> list:
    """The lines of the plan: one row per config, then the recommendation; task: the planned one (its reference,
    whether it is a transformers model); notes: sequence_notes and task_notes."""
    budget, reference = estimate.USABLE * args.gpu_memory, task.reference_kind
    width = max(30, 1 + max(map(len, plans)))  # the config column: a long path keeps the rows in line
    lines = _heading(args, next(iter(plans.values())), budget, reference, list(notes), width)
    fitting, short, peaks, searched = [], [], {}, False  # short: the host would not hold what they offload;
    for name, p in plans.items():  # peaks: each row's; searched: some row's micro batch is "auto"'s
        ds = named[name]
        largest = p.largest_micro(args.gpu_memory)
        micro, auto = (args.micro_batch, False) if args.micro_batch else \
            planner.micro_of(ds, args.world_size // args.sequence_parallel, largest)
        searched |= auto
        peak = peaks[name] = p.peak(micro) if micro >= p.smallest else None
        fits = peak is not None and peak <= budget
        held = host.fits(host.offloaded(p), args.ranks_per_node, args.host_memory)
        theirs = ds_internals.deepspeed_estimate(ds_config.zero_stage(ds), *map(bool, estimate.offloads(ds)),
                                                 p.parameters, p.largest_layer, args.world_size)
        lines.append(f"{name:<{width}}" + "".join(f"{_gb(p.device.get(kind, 0)):>8}" for kind in KINDS)
                     + (f"{_gb(p.device.get('reference')):>8}" if reference else "") +
                     f"{_gb(sum(p.host.values())):>8}{_gb(p.per_sample):>11}{str(micro) + '*' * auto:>6}{_gb(peak):>9}"
                     f"{'no' if not fits else 'yes' if held else 'host':>6}{largest:>8}{_gb(theirs):>8}")
        if fits:
            (fitting if held else short).append((_speed_rank(name), name, peak))
    lines.append(recommend(sorted(fitting), plans, budget, args, sorted(short), named, peaks, bool(task.spec)))
    if any(name.endswith(BF16) for name in plans):
        lines.append(f"{BF16}: the config with DeepSpeed's bf16 section (bf16 weights and gradients, fp32 masters) in "
                     f"place of bf16 autocast (fp32 weights and gradients): faster, less precise")
    if short:
        lines.append(f"host: the GPU would hold it, the host would not: {args.ranks_per_node} rank(s) offload more "
                     f"than the {host.USABLE_HOST * args.host_memory / 1e9:,.1f} GB the machine's memory gives them "
                     f"(--host_memory, --ranks_per_node)")
    if searched:
        lines.append("* the micro batch is \"auto\": the largest that fits and divides a rank's share of the global "
                     "batch, which the run finds for itself at start")
    return lines


def recommend(fitting: list, plans: dict, budget: float, args, short: list, named: dict, peaks: dict,
              text: bool) -> str:
    """The fastest config that fits, and why the faster ones do not; short: those the GPU would hold and the host
    not; named: every config's DeepSpeed dict; peaks: each row's (None: not one sample fits); text: a transformers
    model (LoRA could train it)."""
    shorts = {n for _, n, _ in short}
    if not fitting and short:
        name = short[0][1]
        return (f"recommended: none fits; the GPU would hold {name}, but the host would not hold what it offloads: "
                + host.remedies(args.ranks_per_node, "weights" in plans[name].host, text and not args.lora,
                                ds_config.zero_stage(named[name]) == 3))
    if not fitting:
        best = max(plans.values(), key=lambda p: p.largest_micro(args.gpu_memory))
        if best.largest_micro(args.gpu_memory) and all(peak is None for peak in peaks.values()):  # too few samples
            return (f"recommended: none trains this micro batch: the model trains on no fewer than {best.smallest} "
                    f"samples a micro batch (BatchNorm over a 1x1 map of one sample); raise the micro batch")
        return (f"recommended: none fits this micro batch; {best.config} holds the most, up to "
                f"{best.largest_micro(args.gpu_memory)} sample(s) per micro batch: lower the micro batch and raise "
                f"gradient_accumulation_steps, add ranks, or a GPU with more memory")
    _, name, peak = fitting[0]
    stem = _stem(name)
    faster = [n for n in plans if stem in ORDER and _speed_rank(n) < _speed_rank(name)]
    over = "; ".join((f"{n} would peak at {_gb(peaks[n])}" if peaks[n] else f"{n} would not hold one sample")
                     + (", its host not holding what it offloads" if n in shorts else "") for n in faster)
    weights = "; with bf16 weights in place of autocast's fp32 ones" if name.endswith(BF16) else ""
    return (f"recommended: {name}, peaking at {_gb(peak)} of {_gb(budget)} GB"  # as the rows, to the same digit
            + (f": {ORDER[stem]}" if stem in ORDER else "") + weights + (f" ({over})" if over else ""))


def main(argv=None) -> int:
    """Print the plan; returns the exit code."""
    from app.distributed.launch import prepare_environment
    prepare_environment()
    try:
        args = parse(argv)
        named, task = configs(args), task_of(args)
        plans = measure(args, named, task)
    except UserError as e:
        return report(e)
    lines = table(args, named, plans, task, [*sequence_notes(args, task), *task_notes(task)])
    print("\n".join(lines + activation_notes(plans)))
    skipped = [f"{n} ({why})" for n, why in NOT_PLANNED.items() if not args.deepspeed_config]
    if skipped:
        print("not planned: " + "; ".join(skipped))
    return 0


if __name__ == "__main__":
    sys.exit(main())
