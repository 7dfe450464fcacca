"""Tools beside training: bench, doctor, commcheck, export, build_ops. Each reuses the training core."""
