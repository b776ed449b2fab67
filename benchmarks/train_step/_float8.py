"""The fp8 engines: the same engines with every block's linears trained by torchao's
float8 recipe (`--fp8`: tensorwise or rowwise), emulated on CPU ranks.

Each fp8 engine converts the freshly built model's blocks with torchao's
`convert_to_float8_training` before its own setup, so it times the same matmuls as its
floor (`floor8`, `floorc8`). With `gather` the config sets `enable_fsdp_float8_all_gather`:
FSDP2 then gathers those weights in fp8 and takes their scales after every step with
torchao's `precompute_float8_dynamic_scale_for_fsdp` (as torchtitan does), zeroshard's
stage 3 gathers them in fp8 itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch import nn

from benchmarks.train_step._settings import Settings, Skipped, Stepper

Setup = Callable[[nn.Module, Settings], Stepper]


def convert_blocks(model: nn.Module, s: Settings, gather: bool) -> None:
    """Every linear inside `model.blocks` made torchao's fp8 training linear (`s.fp8`'s
    recipe; the fp8 all-gather with `gather`)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if gather and s.fp8 != "tensorwise":
        raise Skipped(f"the fp8 all-gather takes the tensorwise recipe, not {s.fp8}")
    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(s.fp8),
        emulate=s.device.type != "cuda",
        enable_fsdp_float8_all_gather=gather,
    )
    blocks: Any = model.blocks
    for block in blocks:
        convert_to_float8_training(block, config=config)


def in_float8(setup: Setup, gather: bool = False) -> Setup:
    """`setup` on the model with its blocks converted to fp8 first."""

    def fp8_setup(model: nn.Module, s: Settings) -> Stepper:
        convert_blocks(model, s, gather)
        return setup(model, s)

    return fp8_setup


def precompute_scales(model: nn.Module) -> Callable[[], None]:
    """After FSDP2's optimizer step: every fp8 weight's scale, in one all-reduce."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    return lambda: precompute_float8_dynamic_scale_for_fsdp(model)
