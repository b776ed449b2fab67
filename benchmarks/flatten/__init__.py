"""Time and peak memory of each flattening tier: `python -m benchmarks.flatten`."""
