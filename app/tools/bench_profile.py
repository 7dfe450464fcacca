"""What a mode of the benchmark spends its steps on: torch's profiler over a few steps after the measured ones, written
as tables, with the share of the wall time the device was busy and the graphs torch.compile made (a ZeRO-3 model
breaks into a graph per module that has DeepSpeed's hooks); on a GPU, what was allocated at those steps' peak, by
the line of code that allocated it."""
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType

from app.ds.internals import torch_private
from app.observe import memory_snapshot

STEPS = 3  # profiled steps, run after the measured ones so that the profiler's cost is in no measured step
RECORDED = 1  # then, on a GPU, a step whose allocations are recorded (which costs the host time): in no profiled one
EXTRA_STEPS = STEPS + RECORDED  # the steps a profiled mode runs after its measured ones


class Profile:
    """Started at the first tick after `after` steps, stopped STEPS ticks later, then on a GPU the allocations of
    RECORDED more steps recorded; write() puts the tables in path, stop() ends a recording cut short."""

    def __init__(self, device, after: int):
        self.device, self.after, self.ticks, self.profiler, self.wall = device, after, 0, None, 0.0
        self.memory, self.before, self.recording = None, 0, False  # on a GPU: the recorded step's allocations

    def tick(self):
        """One step ended."""
        self.ticks += 1
        if self.ticks == self.after:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.synchronize()
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
            self.started = time.perf_counter()
        elif self.ticks == self.after + STEPS and self.profiler is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self.wall = time.perf_counter() - self.started
            self.profiler.__exit__(None, None, None)
            self._record()
        elif self.ticks == self.after + EXTRA_STEPS and self.recording:
            torch.cuda.synchronize()
            self.memory = torch_private.memory_snapshot()
            self.stop()

    def _record(self):
        """Record the next step's allocations, on a GPU whose allocator keeps a record (not backend:cudaMallocAsync)."""
        if self.device.type != "cuda":
            return
        self.before = torch.cuda.memory_allocated(self.device)
        try:
            torch_private.record_memory_history(memory_snapshot.MAX_ENTRIES)
            self.recording = True
        except RuntimeError:
            pass

    def stop(self):
        """Stop recording allocations, if it still is (also where the mode ended inside its recorded step)."""
        if self.recording:
            self.recording = False
            torch_private.stop_memory_history()

    def write(self, path: Path, mode: str, graphs: tuple) -> str:
        """The tables of the profiled steps in path; the one-line summary."""
        if self.profiler is None or not self.wall:
            return f"profile {mode}: not reached"
        events = self.profiler.key_averages()
        busy_us = device_busy_us(events)
        cpu_us = sum(e.self_cpu_time_total for e in events)
        summary = (f"profile {mode}: {self.wall / STEPS * 1e3:.1f} ms a step wall, device busy "
                   f"{busy_us / 1e3 / STEPS:.1f} ms ({busy_us / 1e6 / self.wall:.0%}), host ops "
                   f"{cpu_us / 1e3 / STEPS:.1f} ms; {graphs[0]} graphs compiled, {graphs[1]} graph breaks")
        by_device = events.table(sort_by="self_device_time_total", row_limit=25) if self.device.type == "cuda" else ""
        path.write_text(f"{summary}\n\n{by_device}\n\n{events.table(sort_by='self_cpu_time_total', row_limit=40)}\n"
                        f"{peak_table(self.memory, self.before, self.device.index or 0)}")
        return summary


def peak_table(snapshot, before: int, device: int = 0) -> str:
    """The lines that say what was allocated at the peak of the recorded steps ('' when nothing was recorded)."""
    if not snapshot:
        return ""
    peak, groups, cut = memory_snapshot.peak_composition(snapshot, before, device=device)
    rows = [f"{size / 1e9:10.3f} GB  {where}" for where, size in groups]
    head = (f"\nallocated at the peak of the step after the profiled ones: {peak / 1e9:.3f} GB, the largest parts"
            f"{' (the record was cut: of its last part alone)' if cut else ''}:")
    return "\n".join([head, *rows]) + "\n"


def device_busy_us(events) -> float:
    """Microseconds the device ran something in events (key_averages()): its own events alone, kernels, memcpy and
    memset. The aten op that launched a kernel carries the kernel's time as self device time too, so a sum over
    every event counts each kernel twice."""
    return sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA)


def graphs_made() -> tuple:
    """(graphs compiled, graph breaks) so far in this process."""
    return torch_private.dynamo_graphs()
