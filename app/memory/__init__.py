"""Memory: the plan of what a rank holds (plan.py) and the micro batch "auto" found by trial (autobatch.py)."""
