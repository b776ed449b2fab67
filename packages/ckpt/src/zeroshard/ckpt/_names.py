"""Parameter and buffer names as the model's own code spells them.

`torch.compile(module)` returns a wrapper holding the original as its `_orig_mod` child,
so a model compiled before it was wrapped or saved (`model = torch.compile(model)`, then
`deepspeed.initialize`; torchtitan compiles each block before sharding) names a weight
`_orig_mod.layers.0.mlp.weight` or `layers.0._orig_mod.mlp.weight`. Checkpoints, exports
and loads by name use the name without those segments, as torch's DCP
`get_model_state_dict` does: weights then move between the model compiled and not, and
Hugging Face weights load into either.
"""

from __future__ import annotations

_COMPILE_WRAPPER = "_orig_mod"


def canonical_name(name: str) -> str:
    """`name` without torch.compile's `_orig_mod` segments."""
    if _COMPILE_WRAPPER not in name:
        return name
    return ".".join(part for part in name.split(".") if part != _COMPILE_WRAPPER)
