"""A training application for PyTorch models on DeepSpeed, driven by JSON configs."""
