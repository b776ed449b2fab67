"""The engine's configuration: `ZeroConfig` and its frozen policies, their checks, and the
translation of DeepSpeed's config (a `zero_optimization` block, a whole `ds_config.json`,
one under a Hugging Face Trainer). Imports nothing else of the engine."""
