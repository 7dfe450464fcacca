"""--memory_snapshot on (the default): on a CUDA device the run records its allocations, so that a rank that runs
out of memory writes a snapshot of who held the memory to <output_dir>/memory/rank<r>.oom.pickle, which
https://pytorch.org/memory_viz reads, and the run's one line names the file (app/distributed/endings.py).

Recording starts once the micro batch search is over (its trials run out of memory on purpose) and before the run's
model, optimizer and engine are built, so their allocations are in it. It keeps the last MAX_ENTRIES allocations
and frees, each allocation with its Python frames. A rank writes its snapshot when its allocator ran out of memory
since recording started, whatever error the out-of-memory reached the end of the run as; then recording stops.
Nothing is recorded on the CPU.
"""
from pathlib import Path

import torch

from app.distributed import dist
from app.ds.internals import torch_private

FOLDER = "memory"
MAX_ENTRIES = 100_000
"""Allocations and frees kept while recording, the newest: host memory while recording and the file's size grow
with them (scripts/gpu_check.py's oom_snapshot part measures the file and the step time it costs)."""


def snapshot_path(output_dir, rank: int) -> Path:
    """Where rank writes its snapshot when it runs out of memory."""
    return Path(output_dir) / FOLDER / f"rank{rank}.oom.pickle"


def write(path: Path) -> list:
    """Write the snapshot of this process's CUDA memory to path: [path, ''], or [path, why it could not be written]
    (a partial file removed)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch_private.dump_memory_snapshot(path)
        return [str(path), ""]
    except Exception as e:  # noqa: BLE001 (a disk full or anything else: the run's line still says out of memory)
        if path.is_file():
            path.unlink()
        return [str(path), e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"]


def _ooms(device: torch.device) -> int:
    """How many times the device's allocator has run out of memory in this process."""
    return torch.cuda.memory_stats(device).get("num_ooms", 0)


class Recorder:
    """One run's recording, a context that stops it at the end: start(output_dir) before the model is built;
    written() as the run ends on an error."""

    def __init__(self, choice: str, device: torch.device):
        self.device = device if choice == "on" and device.type == "cuda" else None
        self.path, self.ooms = None, 0
        """path: where this rank's snapshot goes, while recording (None when not)."""

    def start(self, output_dir):
        """Record from now (on a CUDA device with --memory_snapshot on)."""
        if self.device is None or self.path is not None:
            return
        try:
            torch_private.record_memory_history(MAX_ENTRIES)
        except RuntimeError as e:  # an allocator that keeps no record (backend:cudaMallocAsync)
            dist.print0(f"memory snapshot: off, the CUDA allocator does not record allocations here "
                        f"({(str(e).strip().splitlines() or [''])[0][:200]})")
            return
        self.path, self.ooms = snapshot_path(output_dir, dist.rank()), _ooms(self.device)

    def written(self):
        """This rank's snapshot, written and recording stopped, when its allocator ran out of memory since start:
        [path, why it could not be written ('' when it was)]; else None (also when nothing was recorded)."""
        if self.path is None or _ooms(self.device) == self.ooms:
            return None
        shot = write(self.path)
        self.stop()
        return shot

    def stop(self):
        """Stop recording (the recorded allocations are forgotten)."""
        if self.path is not None:
            self.path = None
            torch_private.stop_memory_history()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        return False


def peak_composition(snapshot: dict, before: int, top: int = 12, device: int = 0) -> tuple:
    """What was allocated at the highest point of a recorded stretch: (peak bytes, [(bytes, where)] largest first,
    at most top of them, whether the trace was cut). before: bytes allocated when recording started
    (torch.cuda.memory_allocated), one entry of its own less what the stretch freed of it; each allocation made
    while recording goes under the innermost of its Python frames outside torch (the model's line, DeepSpeed's, the
    app's, a compiled graph's file), on the CUDA device of that index. A block counts as freed when its free is
    requested, as torch's memory_allocated counts it; sizes are the requested ones the trace keeps. A trace of
    MAX_ENTRIES or more entries was cut at its start: what it says is of the stretch it kept."""
    traces = snapshot.get("device_traces") or []
    recorded = traces[device] if device < len(traces) else []
    trace = [e for e in recorded if e.get("action") in ("alloc", "free_requested")]
    sizes, now, peak, at = {}, before, before, 0
    for index, entry in enumerate(trace):  # first the point of the peak
        if entry["action"] == "alloc":
            sizes[entry["addr"]] = entry["size"]
            now += entry["size"]
        else:
            now -= sizes.pop(entry["addr"], entry["size"])  # one made before recording, if not in sizes
        if now > peak:
            peak, at = now, index + 1
    alive, kept = {}, before
    for entry in trace[:at]:  # then what was alive there
        if entry["action"] == "alloc":
            alive[entry["addr"]] = entry
        elif alive.pop(entry["addr"], None) is None:
            kept -= entry["size"]
    groups = {"allocated before the recorded steps": kept}
    for entry in alive.values():
        where = _where(entry.get("frames", []))
        groups[where] = groups.get(where, 0) + entry["size"]
    return peak, sorted(groups.items(), key=lambda item: -item[1])[:top], len(recorded) >= MAX_ENTRIES


TORCH_FOLDER = str(Path(torch.__file__).parent) + "/"  # torch's own files; its environment may be under /opt/torch/


def _where(frames: list) -> str:
    """'name (folder/file.py:line)' of the innermost frame outside torch's own files."""
    for frame in frames:
        name = frame.get("filename", "")
        if not name.startswith(TORCH_FOLDER) and not name.startswith("<"):
            return f"{frame.get('name', '?')} ({'/'.join(Path(name).parts[-2:])}:{frame.get('line', 0)})"
    return "torch itself"
