"""Stop requests (SIGTERM, SIGINT, a launcher that went away) agreed on by every rank at a step boundary."""
import os
import signal
import sys
import threading

import psutil

from app.distributed import dist

# Ancestors whose command line names one of these are launchers: if one exits, nobody will wait for us.
LAUNCHER_WORDS = ("deepspeed", "torchrun", "torch.distributed.run", "mpirun", "srun")

_ASKED = threading.Event()  # a stop was asked of this process's current run (a signal, or its launcher went)


def asked() -> bool:
    """Whether a stop was asked of the current run: a rank that is ending on a failure then waits for no other
    (app/distributed/endings.py); the launcher that signalled is ending them all."""
    return _ASKED.is_set()


class StopRequest:
    """Catches stop signals on this rank and agrees with the other ranks on when to stop."""

    def __init__(self, grace_s: float, watch_launcher: bool):
        self.grace_s, self.reason, self.timer = grace_s, "", None
        _ASKED.clear()  # a run before this one in the process may have been asked to stop
        self.vote, self.closed, self.watcher = dist.HostVote(), threading.Event(), None
        self.previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        if watch_launcher:
            launchers = _launcher_ancestors()
            if launchers:
                self.watcher = threading.Thread(target=self._watch, args=(launchers,), daemon=True)
                self.watcher.start()

    def _on_signal(self, signum, frame):
        self.request(signal.Signals(signum).name)

    def request(self, reason: str):
        """Ask to stop at the next step boundary; force the exit if that takes longer than the grace period."""
        if self.reason or self.closed.is_set():
            return
        self.reason = reason
        _ASKED.set()
        self.timer = threading.Timer(self.grace_s, _force_exit, args=(reason, self.grace_s))
        self.timer.daemon = True
        self.timer.start()

    def _watch(self, launchers):
        while not self.closed.wait(1.0):
            if not all(_alive(p) for p in launchers):
                self.request("launcher exited")
                return

    def agreed(self) -> bool:
        """True on every rank at the same step once any rank has asked to stop.

        Each call posts this rank's vote on the host group (gloo, on the CPU) and reads the one posted a
        step earlier, so the check waits neither on the network nor on the device; the stop lands one step
        after the request.
        """
        return self.vote.exchange(bool(self.reason))

    def finish(self):
        """Complete the last posted vote, so no collective is left in flight at teardown."""
        self.vote.finish()
        self.close()

    def close(self):
        """Stop and join this object's threads (a thread still alive at interpreter exit can abort the process), and
        give the signals back: past the run, a launcher's SIGTERM ends the rank at once."""
        self.closed.set()
        if threading.current_thread() is threading.main_thread():
            for sig, handler in self.previous.items():
                signal.signal(sig, handler)
            self.previous = {}
        for thread in (self.timer, self.watcher):
            if thread is not None and thread is not threading.current_thread():
                if thread is self.timer:
                    thread.cancel()
                thread.join()


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
