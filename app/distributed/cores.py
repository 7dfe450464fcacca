"""The cores a process may use, for its CPU threads and its loader workers."""
import os


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, which Slurm and a container's cpuset set, where
    os.cpu_count() counts every core of the machine. A CPU quota (docker --cpus, a Kubernetes CPU limit: cgroup's
    cpu.max) is not read here; OMP_NUM_THREADS sets the threads under one."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
