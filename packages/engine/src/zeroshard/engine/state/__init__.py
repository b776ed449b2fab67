"""The state an engine reads and writes: its checkpoints (and DeepSpeed's), safetensors
loading, `model.state_dict()` / `load_state_dict()` with full tensors, `full_state_dict`
and `gathered_parameters`; gradients and optimizer state read whole (`full_grad`,
`full_optimizer_state`) or as per-parameter norms (`grad_norms`). Imports `config` and `runtime`."""
