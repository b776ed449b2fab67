"""Leaf unit vs per-parameter fetch of an MoE layer: `python -m benchmarks.leaf_fetch`."""
