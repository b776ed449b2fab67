"""What every engine's setup shares: the run's settings, the optimizer, the hybrid shape.

A setup takes a freshly built fp32 model on the benchmark device and returns a `Stepper`:
one call is one full training step (forward, backward, optimizer step, zero grad) on a
micro-batch. All engines use the same optimizers with the same hyperparameters
(`make_optimizers`: `--optimizer adamw`, torch's AdamW, fused on CUDA; or `muon`, torch's
recipe of torch.optim.Muon on the hidden matrices and that AdamW on the rest); what
differs is only how parameters, gradients and optimizer state are distributed and cast.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks._common._models import optimizers

Stepper = Callable[[torch.Tensor, torch.Tensor], None]

# Per-engine lines for the report (rank 0), e.g. the bytes a compiled step gathers.
NOTES: dict[str, str] = {}


@dataclass(frozen=True)
class Settings:
    """What every engine shares: device, compute dtype, clipping, micro-batch, extras."""

    device: torch.device
    dtype: torch.dtype
    clip: float
    micro_batch: int
    zs_config: dict[str, Any]
    shard_group_size: int = 2  # hybrid engines: shard within this many ranks
    fp8: str = "tensorwise"  # the fp8 engines' torchao recipe
    tp: int = 1  # tensor-parallel engines: consecutive ranks sharing each layer
    optimizer: str = "adamw"  # `--optimizer`: adamw, or muon (torch's Muon recipe)


def make_optimizers(
    model: nn.Module, s: Settings, params: list[Any] | None = None
) -> list[torch.optim.Optimizer]:
    """The run's optimizers (`s.optimizer`) over `model`'s parameters, or over `params`,
    tensors that stand for them in the same order (floor32's fp32 masters)."""
    from zeroshard.engine.planner._whole import hidden_matrices

    chosen = list(model.parameters()) if params is None else params
    return optimizers(chosen, hidden_matrices(model), s.device, s.optimizer)


class Skipped(Exception):
    """An engine that does not apply to this world (a row says why; not a failure)."""


def hybrid_shape(s: Settings) -> tuple[int, int]:
    """(replicate, shard) group sizes of a hybrid engine; `Skipped` where it would not be one."""
    world, shard = dist.get_world_size(), s.shard_group_size
    if world % shard or world == shard:
        raise Skipped(
            f"shard within {shard} needs {2 * shard}, {3 * shard}, ... ranks, not {world}"
        )
    return world // shard, shard


def dtype_name(dtype: torch.dtype) -> str:
    """The config spelling of a compute dtype (`bf16`)."""
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
