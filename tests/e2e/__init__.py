"""Tests that run the app for real: subprocesses, launchers, spawned ranks, DeepSpeed engines, faults."""
