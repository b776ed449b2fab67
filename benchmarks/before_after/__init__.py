"""One benchmark command on two source trees, alternately: `python -m benchmarks.before_after`."""
