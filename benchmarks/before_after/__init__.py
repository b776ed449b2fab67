"""One benchmark command run on two source trees, alternately: `python -m benchmarks.before_after`."""
