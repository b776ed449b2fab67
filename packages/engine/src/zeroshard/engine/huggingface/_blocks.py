"""`TrainingArguments(torch_compile=True)` under `ZeroTrainer`: the blocks compiled.

The Trainer has accelerate compile the whole model. Under ZeroTrainer accelerate leaves
the model alone (it is marked as prepared), and compiling it whole after `initialize`
would fail anyway: Dynamo cannot trace the engine's hooks. So ZeroTrainer compiles each
block's `forward` after `initialize` instead, as docs/compile.md's block mode does: the
hooks run eagerly around the blocks' graphs, and Dynamo compiles one block for all of
the same shape. A block is what the model's `_no_split_modules` names (the decoder layer
classes of a transformers model). The Trainer turns the KV cache off for training
(`TrainingArguments.use_cache`, False by default), which the blocks need: the cache's
per-layer state would recompile every layer.
"""

from __future__ import annotations

import torch
from torch import nn


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` whose classes its `_no_split_modules` names; none is an error."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(
            "ZeroTrainer: TrainingArguments(torch_compile=True) compiles the model's blocks, "
            f"the classes its `_no_split_modules` names, and {type(model).__name__} names "
            f"none that it holds ({sorted(names)}); set `_no_split_modules` to the class names "
            "of its repeated blocks, or train without torch_compile"
        )
    return blocks


def compile_blocks(blocks: list[nn.Module], *, backend: str | None, mode: str | None) -> None:
    """Compile each block's `forward` (not the module: its hooks must stay eager)."""
    for block in blocks:
        block.forward = torch.compile(block.forward, backend=backend or "inductor", mode=mode)
