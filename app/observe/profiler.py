"""--profile FIRST:LAST: a torch.profiler trace of those optimizer steps (counted from the run's start, 1-based), on
the main rank or on every rank (--profile_ranks all), as a Chrome trace that Perfetto (ui.perfetto.dev) and
TensorBoard's profiler read."""
from pathlib import Path

import torch

from app.distributed import dist
from app.errors import UserError
from app.settings import steps_of

FOLDER = "profile"


class StepProfiler:
    """Records from the end of step first - 1 to the end of step last (each step's log row, evaluation and save
    with it); at() is told the optimizer steps done, after that step's work."""

    def __init__(self, first: int, last: int, path: Path, cuda: bool):
        self.first, self.last, self.path, self.recording, self.written = first, last, path, None, False
        self.start = first  # the first step recorded: a run resumed inside the steps records from the next one
        self.activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda
                                                                   else [])

    def at(self, done: int):
        """Start before step first, stop and write after step last."""
        if self.written:
            return
        if self.recording is None and self.first - 1 <= done < self.last:
            self.recording = torch.profiler.profile(activities=self.activities, record_shapes=True,
                                                    with_stack=False, profile_memory=True)
            self.recording.__enter__()
            self.start = done + 1
        elif self.recording is not None and done >= self.last:
            self._write(self.last)

    def finish(self, done: int):
        """At the run's end, `done` steps done: a recording the run ended inside (stopped early, on request) is
        written with the steps it holds; steps the run never reached (or had passed when it resumed) are said."""
        if self.written:
            return
        if self.recording is not None:
            self._write(done)
        else:
            print(f"profile: nothing recorded: this run, ended at step {done}, took none of steps "
                  f"{self.first}-{self.last} (it resumed after them or ended before them)", flush=True)

    def _write(self, last: int):
        """Stop, and write the steps recorded, start to last, named so."""
        path = self.path.with_name(self.path.name.replace(f"steps{self.first}-{self.last}.",
                                                          f"steps{self.start}-{last}."))
        self.recording.__exit__(None, None, None)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.recording.export_chrome_trace(str(path))
        self.written = True  # the run records once
        print(f"profile: steps {self.start}-{last} written to {path} (open it in ui.perfetto.dev, or with "
              f"TensorBoard's profiler: tensorboard --logdir {path.parent})", flush=True)


def for_run(text: str, ranks: str, steps: int, output_dir: Path, device: torch.device):
    """The run's StepProfiler on the ranks that record (None elsewhere, and without --profile); steps past the run's
    are one line."""
    found = steps_of(text)
    if not found:
        return None
    if found[1] > steps:
        raise UserError(f"--profile {text}: the run takes {steps} optimizer steps; record steps within them")
    if not (dist.is_main() or ranks == "all"):
        return None
    name = f"rank{dist.rank()}.steps{found[0]}-{found[1]}.pt.trace.json"
    dist.print0(f"profile: steps {found[0]}-{found[1]} on {'every rank' if ranks == 'all' else 'rank 0'} -> "
                f"{Path(output_dir) / FOLDER}")
    return StepProfiler(*found, Path(output_dir) / FOLDER / name, device.type == "cuda")
