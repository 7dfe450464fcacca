"""Tools beside training: bench, doctor, commcheck, export, plan, restart, build_ops. Each reuses the training core."""
