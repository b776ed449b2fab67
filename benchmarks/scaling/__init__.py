"""Scaling report from train_step runs: `python -m benchmarks.scaling`."""
