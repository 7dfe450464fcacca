"""The cores a process may use: its CPU affinity (what Slurm and containers limit), not the machine's."""
import os

import pytest

from app.distributed.cores import usable_cores


def test_the_cores_are_this_processs_affinity():
    assert usable_cores() == len(os.sched_getaffinity(0)) >= 1


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_a_process_pinned_to_one_core_counts_one_whatever_the_machine_has():
    """As under `srun --cpus-per-task 1` or `taskset -c 0`: the threads and loader workers follow the pin."""
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(before)})
        assert usable_cores() == 1
    finally:
        os.sched_setaffinity(0, before)
    assert usable_cores() == len(before)
