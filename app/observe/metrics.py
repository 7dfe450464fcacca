"""Meters reduced across ranks, throughput and model FLOP utilisation, peak memory, the training clock.
The rank-0 sinks (progress bar, CSV, TensorBoard, summary, plot) live in app/observe/runlog.py."""
import contextlib
import os
import resource
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from app.distributed import dist



class Meter:
    """Sums, their weight and a count of samples, kept on the device (no host sync per step), reduced across ranks
    on read. copies: how many ranks add each sample alike (AutoTP's shards of one replica: engine.autotp_size()),
    whose sum is divided by them so that each sample counts once."""

    def __init__(self, names, device, copies: int = 1):
        self.names, self.copies = list(names), max(1, copies)
        self.totals = torch.zeros(len(self.names) + 2, dtype=torch.float64, device=device)
        self.not_finite = torch.zeros((), dtype=torch.bool, device=device)  # a sum added since take_not_finite()

    def add(self, count: torch.Tensor, weight: torch.Tensor = None, **sums: torch.Tensor):
        """Add per-batch sums (tensors, each value times its weight), the weight they carry in all (default: count)
        and the number of samples they cover."""
        self.totals[-1] += count
        self.totals[-2] += count if weight is None else weight
        for i, name in enumerate(self.names):
            self.totals[i] += sums[name]
            self.not_finite |= ~torch.isfinite(sums[name])

    def take_not_finite(self) -> torch.Tensor:
        """Whether a sum added since the last call was not finite (a device bool); cleared."""
        flag = self.not_finite.clone()
        self.not_finite.zero_()
        return flag

    def reduce(self) -> dict:
        """Global weighted means over every rank since the last reset, plus the global 'count'; then reset."""
        totals = [total / self.copies for total in dist.host_sum(self.totals.tolist())]  # read once per log row
        self.totals.zero_()
        weight = totals[-2]
        result = {name: totals[i] / weight if weight else float("nan") for i, name in enumerate(self.names)}
        result["count"] = totals[-1]
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


_measured = {}  # (device, dtype, threads) -> FLOP/s: a process measures once, however many jobs it runs


def matmul_flops(device: torch.device, dtype: torch.dtype, seconds: float = 0.5) -> float:
    """FLOP/s of square matmuls in dtype on device with this process's threads, measured for about `seconds` the
    first time this process asks (the machine's peak is the same for its later jobs).

    It times F.linear, the kernel nn.Linear layers run: on CPU, bf16 torch.matmul takes a path ten
    times slower than the one linear layers get, which would make utilisation look above 1. On a GPU
    the products are queued in chunks and the device synchronised once per chunk, not per product.
    """
    key = (str(device), dtype, torch.get_num_threads())
    if key not in _measured:
        _measured[key] = _matmul_flops(device, dtype, seconds)
    return _measured[key]


def _matmul_flops(device: torch.device, dtype: torch.dtype, seconds: float) -> float:
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


def free_memory_bytes(device: torch.device) -> int:
    """Memory a rank could still take now: on a GPU, what CUDA has free plus what torch's allocator holds unused;
    on a CPU, the host's available memory (shared by the ranks of a node)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    import psutil
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
    return psutil.virtual_memory().available // max(ranks_here, 1)


def reset_peak_memory(device: torch.device):
    """Start peak_memory_bytes afresh from what this rank holds now, on the device and on the host (Linux:
    clear_refs 5)."""
    import gc
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
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


def throughput_for(tokens_per_sample: int, flops: float, device: torch.device, dtype: torch.dtype,
                   peak_flops: float) -> Throughput:
    """Tokens/s and model FLOP utilisation where samples have tokens; the peak per rank is peak_flops (--peak_flops)
    or a matmul measured now on every rank at once, as they will share the machine while training."""
    if not tokens_per_sample:
        return Throughput()
    dist.barrier()
    per_rank = peak_flops or dist.host_sum([matmul_flops(device, dtype)])[0] / dist.world_size()
    dist.print0(f"throughput: {flops / tokens_per_sample / 1e6:.1f} MFLOP per token trained, peak "
                f"{per_rank / 1e9:.1f} GFLOP/s per rank ({'--peak_flops' if peak_flops else 'measured'})")
    return Throughput(tokens_per_sample, flops, per_rank * dist.world_size())
