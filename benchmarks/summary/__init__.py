"""The summary that opens docs/benchmarks.md, from its run sections
(`python -m benchmarks.summary`)."""
