"""Benchmark scripts; each is run from the repository root as `python -m benchmarks.<name>`
(or `torchrun ... -m benchmarks.<name>`), which makes `benchmarks` and `examples` importable."""
