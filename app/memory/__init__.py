"""Memory: the plan of what a rank holds (estimate.py, planner.py), the host's memory against what offload keeps
there (host.py), and the micro batch "auto" found by trial (autobatch.py)."""
