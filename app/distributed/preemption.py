"""Stop requests (SIGTERM, SIGINT, a launcher that went away), agreed by every rank at a step boundary through the
run's Board (app/distributed/endings.py)."""
import os
import signal
import sys
import threading
import time

import psutil

# Ancestors whose command line names one of these are launchers: if one exits, nobody will wait for us.
LAUNCHER_WORDS = ("deepspeed", "torchrun", "torch.distributed.run", "mpirun", "srun")


# SIGUSR1: what Slurm's --signal=USR1@<seconds> sends ahead of a time limit or a preemption (scripts/train.sbatch)
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StopRequest:
    """Catches stop signals on this rank, looks for its launcher at step boundaries, and agrees with the other ranks
    on the step to stop at. A request that the run cannot honour within the grace period ends the process."""

    def __init__(self, board, grace_s: float, watch_launcher: bool):
        self.board, self.grace_s, self.reason, self.timer = board, grace_s, "", None
        self.launchers = _launcher_ancestors() if watch_launcher else []
        self.looked = time.monotonic()
        self.previous = {sig: signal.signal(sig, self._on_signal) for sig in SIGNALS}

    def __enter__(self):
        return self

    def __exit__(self, *failed):
        self.close()

    def _on_signal(self, signum, frame):
        self.request(signal.Signals(signum).name)

    def request(self, reason: str):
        """Ask to stop at a step boundary; end the process if that takes longer than the grace period (a thread,
        which ends it even while the main thread waits in a collective)."""
        if self.reason:
            return
        self.reason, self.board.asked = reason, True  # a rank ending on a failure then waits for nobody
        self.timer = threading.Timer(self.grace_s, _force_exit, args=(reason, self.grace_s))
        self.timer.daemon = True
        self.timer.start()

    def agreed(self, step: int) -> bool:
        """At the boundary after step: True on every rank at the same step once any rank has asked to stop (it lands
        two steps after the request). The launcher is looked for once a second."""
        if self.launchers and time.monotonic() - self.looked > 1.0:
            self.looked = time.monotonic()
            if not all(_alive(p) for p in self.launchers):
                self.request("launcher exited")
        return self.board.stopping(bool(self.reason), step)

    def close(self):
        """Give the signals back (past the run, a launcher's SIGTERM ends the rank at once) and stop the timer."""
        if threading.current_thread() is threading.main_thread():
            for sig, handler in self.previous.items():
                signal.signal(sig, handler)
            self.previous = {}
        if self.timer is not None:
            self.timer.cancel()
            self.timer.join()


def _launcher_ancestors() -> list:
    """The launcher processes directly above this one (deepspeed's runner and launch.py, torchrun, ...)."""
    found = []
    for process in psutil.Process().parents():
        try:
            command = " ".join(process.cmdline())
        except psutil.Error:
            break
        if not any(word in command for word in LAUNCHER_WORDS):
            break
        found.append(process)
    return found


def _alive(process) -> bool:
    """Running and not a zombie (a killed launcher whose parent has not reaped it yet counts as gone)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _force_exit(reason: str, grace_s: float):
    print(f"error: still running {grace_s:.0f} s after {reason}; exiting without a final checkpoint "
          f"(raise --grace_period if saving takes longer)", file=sys.stderr, flush=True)
    os._exit(1)
