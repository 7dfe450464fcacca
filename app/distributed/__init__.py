"""Ranks and processes: launch time (launch.py) apart from run time (dist.py), stop requests (preemption.py),
what processes send each other (wire.py), what node shells are handed (node_shell.py), how a run ends when a rank
fails (endings.py), the CPU cores a process may use (cores.py)."""
