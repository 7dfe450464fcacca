"""Tests of functions and classes in this process: no subprocess, launcher, spawned rank nor DeepSpeed engine."""
