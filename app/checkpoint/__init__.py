"""Checkpoints: the trainer state and saving (save.py), resume (resume.py), disk space (disk.py), the run folder (outdir.py)."""
