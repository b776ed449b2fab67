"""`NamedTrainingState`: a run's full training state addressed by parameter name.

A resume from a checkpoint whose flat layout is not ours (DeepSpeed's partitions, or a
zeroshard checkpoint converted from one) cannot copy shard ranges: each rank instead
reads, for every parameter slice in its own shard, the same elements of that
parameter's fp32 master and of each optimizer state tensor. The specs here read any
element range on demand (`RangeSpec.read_range`), so a rank never holds more than its
shard of anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from zeroshard.ckpt._writer import RangeSpec


@dataclass(frozen=True)
class NamedParamGroup:
    """One optimizer param group: its parameters and the state shared by them.

    `hyperparameters` are the saved `param_groups` entry without `params` (lr, betas,
    eps, weight_decay...); `scalars` the per-parameter scalar state every parameter of
    the group shares (Adam's `step`).
    """

    names: tuple[str, ...]
    hyperparameters: Mapping[str, Any]
    scalars: Mapping[str, float]


@dataclass(frozen=True)
class LossScaleState:
    """fp16 dynamic loss scaling: the scale and the good steps since the last change."""

    scale: float
    good_steps: int


@dataclass(frozen=True)
class NamedTrainingState:
    """Weights, optimizer state, loss scale and step of a run, by parameter name.

    `masters` holds the fp32 value of every parameter (trainable and frozen) by its
    canonical name; `aliases` maps tied names to canonical ones; `optimizer_state`
    maps a state key (`exp_avg`) to each trainable parameter's tensor of it;
    `not_carried` names what the source holds that cannot be carried over (a
    scheduler's state), each with why. `stage` and `world_size` are the source run's.
    `experts` (DeepSpeed MoE) maps an expert parameter's name to the names `masters` and
    `optimizer_state` hold its value under on each expert-parallel rank (instance), in
    rank order; the first is the name itself.
    """

    source: str
    stage: int
    world_size: int
    step: int
    masters: Mapping[str, RangeSpec]
    aliases: Mapping[str, str]
    buffers: Mapping[str, RangeSpec]
    frozen: frozenset[str]
    param_groups: tuple[NamedParamGroup, ...]
    optimizer_state: Mapping[str, Mapping[str, RangeSpec]]
    loss_scale: LossScaleState | None = None
    not_carried: tuple[str, ...] = field(default_factory=tuple)
    experts: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
