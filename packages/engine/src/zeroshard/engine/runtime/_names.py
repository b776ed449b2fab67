"""Parameter and buffer names as the model's own code spells them (see ckpt's `_names`).

A module compiled with `torch.compile` before `initialize` (torchtitan's order: compile
each block, then shard) is replaced by a wrapper that holds the original as its
`_orig_mod` child, so torch names a weight under it `layers.0._orig_mod.mlp.weight`.
Everything the engine names (flat layouts, so checkpoints and exports; `full_state_dict`;
loading by name) drops that segment: the weights then load into the model compiled or
not, and Hugging Face weights load into the compiled one. `model.state_dict()` keeps
torch's own keys.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from zeroshard.ckpt import canonical_name

__all__ = ["canonical_name", "named_buffers", "named_parameters"]


def named_parameters(
    model: nn.Module, *, remove_duplicate: bool = True
) -> Iterator[tuple[str, nn.Parameter]]:
    """`model.named_parameters()` under canonical names."""
    for name, p in model.named_parameters(remove_duplicate=remove_duplicate):
        yield canonical_name(name), p


def named_buffers(
    model: nn.Module, *, remove_duplicate: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """`model.named_buffers()` under canonical names."""
    for name, b in model.named_buffers(remove_duplicate=remove_duplicate):
        yield canonical_name(name), b
