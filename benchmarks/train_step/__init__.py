"""Time one training step of a model under several engines: `python -m benchmarks.train_step`."""
