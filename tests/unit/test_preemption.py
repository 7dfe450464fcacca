"""Stop requests: a signal asks the run to stop; once the run is over, the signals are the process's again."""
import os
import signal

from app.distributed import preemption


def test_a_signal_asks_to_stop_and_a_closed_request_gives_the_signals_back():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    stop = preemption.StopRequest(60, watch_launcher=False)
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.reason == "SIGTERM" and stop.agreed(), "one process: its own vote"
    stop.close()
    assert {sig: signal.getsignal(sig) for sig in before} == before, "a launcher's SIGTERM past the run ends it"
    assert not stop.timer.is_alive(), "the grace period's timer is stopped"
