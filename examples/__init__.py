"""Runnable training scripts and the models they train (`examples.gpt`, `examples.llama`),
importable from the repository root, e.g. by `python -m benchmarks.train_step`."""
