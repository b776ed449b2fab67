"""The largest GPT one GPU trains with optimizer offload: `python -m benchmarks.offload`."""
