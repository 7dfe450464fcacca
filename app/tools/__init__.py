"""Tools beside training: bench, doctor, commcheck, export, plan, restart, build_ops, try_configs. Each reuses the
training core."""
