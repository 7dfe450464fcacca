"""Meters reduced across ranks, and the rank-0 sinks: progress bar, CSV, TensorBoard, summary, plot."""
import contextlib
import csv
import json
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from app import dist

CSV_FIELDS = ["step", "epoch", "loss", "lr", "samples_per_s", "tokens_per_s", "mfu", "eval_loss", "eval_accuracy",
              "eval_perplexity"]
SHOWN = ("loss", "lr", "samples_per_s", "tokens_per_s", "mfu", "eval_loss", "eval_accuracy", "eval_perplexity")


class Meter:
    """Sums and counts kept on the device (no host sync per step), reduced across ranks on read."""

    def __init__(self, names, device):
        self.names = list(names)
        self.totals = torch.zeros(len(self.names) + 1, dtype=torch.float64, device=device)

    def add(self, count: torch.Tensor, **sums: torch.Tensor):
        """Add per-batch sums (tensors) and the number of samples they cover."""
        self.totals[-1] += count
        for i, name in enumerate(self.names):
            self.totals[i] += sums[name]

    def reduce(self) -> dict:
        """Global means over every rank since the last reset, plus the global 'count'; then reset."""
        totals = dist.host_sum(self.totals.tolist())  # read on the host once per log row, summed on the host group
        self.totals.zero_()
        count = totals[-1]
        result = {name: totals[i] / count if count else float("nan") for i, name in enumerate(self.names)}
        result["count"] = count
        return result


@dataclass
class Throughput:
    """Turns samples per second into tokens per second and model FLOP utilisation where they apply."""
    tokens_per_sample: int = 0
    flops_per_sample: float = 0.0
    peak_flops: float = 0.0
    """FLOP/s of all ranks together."""

    def rates(self, samples: float, seconds: float) -> dict:
        """samples_per_s, and tokens_per_s and mfu when known."""
        per_s = samples / seconds if seconds else 0.0
        rates = {"samples_per_s": per_s}
        if self.tokens_per_sample:
            rates["tokens_per_s"] = per_s * self.tokens_per_sample
        if self.flops_per_sample and self.peak_flops:
            rates["mfu"] = per_s * self.flops_per_sample / self.peak_flops
        return rates


def matmul_flops(device: torch.device, dtype: torch.dtype, seconds: float = 0.5) -> float:
    """FLOP/s of square matmuls in dtype on device with this process's threads, measured for about `seconds`.

    It times F.linear, the kernel nn.Linear layers run: on CPU, bf16 torch.matmul takes a path ten
    times slower than the one linear layers get, which would make utilisation look above 1. On a GPU
    the products are queued in chunks and the device synchronised once per chunk, not per product.
    """
    cuda = device.type == "cuda"
    n, chunk = (4096, 20) if cuda else (1024, 1)
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    F.linear(a, b)  # warm-up: kernels chosen, memory allocated
    _synchronize(device)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(chunk):
            F.linear(a, b)
        count += chunk
        _synchronize(device)
    return 2.0 * n ** 3 * count / (time.perf_counter() - start)


def _synchronize(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Dense (no sparsity) tensor-core peaks from the vendors' datasheets, FLOP/s per GPU, (bf16 and fp16, fp32 as
# TF32 matmuls), by exact part: the PCIe and NVL parts of a name run slower clocks and fewer SMs than its SXM.
# Papers report MFU against these; the app's own MFU uses a measured matmul.
DATASHEET_PARTS = (
    (r"H100.*NVL", (835.5e12, 417.5e12)),
    (r"H100.*PCIe", (756.5e12, 378.0e12)),
    (r"H100.*(SXM|HBM3)|GH200", (989.4e12, 494.7e12)),
    (r"H200.*NVL", (835.5e12, 417.5e12)),
    (r"H200", (989.4e12, 494.7e12)),
    (r"A100", (312.0e12, 156.0e12)),
)


def datasheet_peak(name: str, dtype: torch.dtype):
    """The dense datasheet peak of the GPU called name (torch.cuda.get_device_name) in dtype, or None when
    the part is not known exactly."""
    import re
    for pattern, (half, tf32) in DATASHEET_PARTS:
        if re.search(pattern, name):
            return {torch.bfloat16: half, torch.float16: half, torch.float32: tf32}.get(dtype)
    return None


def datasheet_flops(device: torch.device, dtype: torch.dtype):
    """The datasheet's dense peak of this GPU in dtype, or None for CPUs and GPUs not known exactly."""
    if device.type != "cuda":
        return None
    return datasheet_peak(torch.cuda.get_device_name(device), dtype)


def peak_memory_bytes(device: torch.device) -> int:
    """Largest memory this rank has held: CUDA allocator peak on GPU, max resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:  # VmHWM, unlike ru_maxrss, follows reset_peak_memory and excludes the pre-exec parent of a spawned rank
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_memory(device: torch.device):
    """Start peak_memory_bytes afresh from what this rank holds now (Linux on CPU: clear_refs 5)."""
    import gc
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back, so the new peak starts from live memory
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


class Stopwatch:
    """Training time between laps, leaving out the time spent inside paused() blocks (evaluation, saving)."""

    def __init__(self):
        self.start = time.perf_counter()

    def lap(self) -> float:
        """Seconds since the last lap (or the start), paused time excluded."""
        now = time.perf_counter()
        elapsed, self.start = now - self.start, now
        return elapsed

    @contextlib.contextmanager
    def paused(self):
        began = time.perf_counter()
        try:
            yield
        finally:
            self.start += time.perf_counter() - began


class RunLog:
    """Everything the main rank writes; on other ranks (and with no output_dir) it writes nothing."""

    def __init__(self, output_dir, total_steps: int, resumed_step: int = 0, show_progress=None,
                 throughput: "Throughput" = None):
        """Start metrics afresh, or (resumed_step > 0) keep the rows up to that step and append. show_progress:
        True draws the bar, False prints plain lines, None (default) draws it only on a terminal."""
        self.active = dist.is_main() and output_dir is not None
        self.output_dir = output_dir
        self.throughput = throughput or Throughput()
        self.rows = []
        if not self.active:
            return
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm
        output_dir.mkdir(parents=True, exist_ok=True)
        if resumed_step:  # rows logged after the checkpoint are redone by this run
            self.rows = [r for r in read_rows(output_dir / "metrics.csv") if r["step"] <= resumed_step]
        else:
            for stale in (output_dir / "tensorboard").glob("events.out.tfevents.*"):  # an overwritten run's
                stale.unlink()
        self.csv_file = open(output_dir / "metrics.csv", "w", newline="")
        self.csv = csv.DictWriter(self.csv_file, fieldnames=CSV_FIELDS)
        self.csv.writeheader()
        for row in self.rows:
            self.csv.writerow({k: _fmt(row.get(k)) for k in CSV_FIELDS})
        self.tb = SummaryWriter(str(output_dir / "tensorboard"), purge_step=resumed_step + 1 if resumed_step else None)
        # disable=None: a bar on a terminal, plain log lines when output goes to a file or pipe
        self.bar = tqdm(total=total_steps, initial=resumed_step, unit="step", dynamic_ncols=True,
                        disable=None if show_progress is None else not show_progress, file=sys.stdout)
        self.plain = self.bar.disable

    def write_row(self, row: dict):
        """One metrics.csv row; also TensorBoard scalars and the progress bar or a log line."""
        if not self.active:
            return
        self.rows.append(row)
        self.csv.writerow({k: _fmt(row.get(k)) for k in CSV_FIELDS})
        self.csv_file.flush()
        for key, value in row.items():
            if key not in ("step", "epoch") and value is not None:
                self.tb.add_scalar(key, value, row["step"])
        shown = {k: f"{row[k]:.4g}" for k in SHOWN if row.get(k) is not None}
        if self.plain:
            print(f"step {row['step']} epoch {row['epoch']} " + " ".join(f"{k} {v}" for k, v in shown.items()),
                  flush=True)
        else:
            self.bar.set_postfix(shown, refresh=False)

    def rates(self, samples: float, seconds: float) -> dict:
        """samples_per_s, and tokens_per_s and mfu where the task has tokens."""
        return self.throughput.rates(samples, seconds)

    def train_row(self, step: int, epoch: int, loss: float, lr: float, samples: float, seconds: float):
        """The row of a log interval: its mean loss, learning rate and throughput."""
        self.write_row({"step": step, "epoch": epoch, "loss": loss, "lr": lr, **self.rates(samples, seconds)})

    def advance(self, steps: int):
        """Move the progress bar on by steps optimizer steps."""
        if self.active and steps:
            self.bar.update(steps)

    def message(self, text: str):
        """A line for the user that does not break the progress bar."""
        if self.active:
            self.bar.write(text, file=sys.stdout) if not self.plain else print(text, flush=True)

    def finish(self, summary: dict):
        """Write summary.json and loss.png, close every file."""
        if not self.active:
            return
        self.bar.close()
        self.tb.close()
        self.csv_file.close()
        (self.output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot_losses(self.rows, self.output_dir / "loss.png")


def read_rows(path: Path) -> list:
    """metrics.csv rows with numbers parsed and empty cells as None ([] when there is no file)."""
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return [{k: (None if v == "" else int(v) if k in ("step", "epoch") else float(v)) for k, v in row.items()}
                for row in csv.DictReader(f)]


def _fmt(value):
    if value is None:
        return ""
    return f"{value:.8g}" if isinstance(value, float) else value


def plot_losses(rows, path: Path):
    """Training and evaluation loss against step, saved as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    train = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
    evals = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
    if train:
        ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


RUN_FILES = ("metrics.csv", "summary.json", "loss.png")


def check_output_dir(path: Path, overwrite: bool, resume: bool = False) -> str:
    """Why path cannot take this run's files, or '' when it can (creates it if missing)."""
    existing = [name for name in RUN_FILES if (path / name).exists()]
    if existing and not (overwrite or resume):
        return (f"output directory {path} already holds a run ({', '.join(existing)}); "
                f"pick a new --output_dir, --resume auto to continue it, or --overwrite")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{dist.rank()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        return f"cannot write to output directory {path}: {e.strerror}; pick a writable --output_dir"
    return ""
