"""The state an engine reads and writes: its checkpoints (and DeepSpeed's), safetensors
loading, `model.state_dict()` / `load_state_dict()` with full tensors, `full_state_dict`
and `gathered_parameters`. Imports `config` and `runtime`."""
