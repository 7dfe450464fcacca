"""Stop requests: a signal asks the run to stop; once the run is over, the signals are the process's again."""
import os
import signal

from app.distributed import endings, preemption


def test_a_signal_asks_to_stop_and_a_closed_request_gives_the_signals_back():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    board = endings.Board()
    stop = preemption.StopRequest(board, 60, watch_launcher=False)
    assert not stop.agreed(1)
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.reason == "SIGTERM" and stop.agreed(2), "one process: it stops at once"
    assert board.asked, "a rank ending on a failure now waits for nobody"
    stop.close()
    assert {sig: signal.getsignal(sig) for sig in before} == before, "a launcher's SIGTERM past the run ends it"
    assert not stop.timer.is_alive(), "the grace period's timer is stopped"
    slurm = preemption.StopRequest(endings.Board(), 60, watch_launcher=False)
    os.kill(os.getpid(), signal.SIGUSR1)  # Slurm's --signal=USR1@120, ahead of the time limit
    assert slurm.reason == "SIGUSR1" and slurm.agreed(1)
    slurm.close()
