"""The checks `initialize` runs on its inputs before it changes anything."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.runtime._state import is_initialized


def check_model(model: nn.Module, cfg: ZeroConfig) -> None:
    """A model not yet initialized, in a launched job, with meta parameters only at stage 3."""
    if is_initialized(model):
        raise ValueError("this model was already initialized by zeroshard")
    if not torch.distributed.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: launch with torchrun and call "
            "zeroshard.comm.init_process_group() first (torch's own works too, but comes up "
            "unreliably after torchrun restarts: docs/reliability.md)"
        )
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if meta and cfg.stage != 3:
        raise ValueError(
            f"parameters {meta[:3]}... are on the meta device: partitioned init "
            "needs stage 3 (or materialize the model before initialize())"
        )
    meta_buffers = [n for n, b in model.named_buffers() if b.is_meta]
    if meta_buffers:
        raise ValueError(
            f"buffers {meta_buffers} are on the meta device: materialize them "
            "before initialize() (only parameters are materialized unit by unit)"
        )


def check_evaluation_config(cfg: ZeroConfig) -> None:
    """Refuse, for a model initialized without an optimizer, the settings that exist only
    for one: CPU offload is of an optimizer's state and step (its other settings need
    `offload.optimizer`). The rest of the config (loss scaling, reduce dtype and buckets)
    concerns gradients, which such a model never takes: ignored."""
    if cfg.offload.optimizer:
        raise ValueError(
            "offload.optimizer (offload_optimizer) offloads an optimizer's state and step, "
            "and initialize() was given no optimizer (evaluation only): turn it off (and "
            "offload_params with it, which needs it)"
        )


def check_module_paths(model: nn.Module, process_groups: Mapping[str, Any]) -> None:
    """Every key of `process_groups` names a module of `model`."""
    paths = {name for name, _ in model.named_modules()}
    unknown = [p for p in process_groups if p not in paths]
    if unknown:
        raise ValueError(f"process_groups names {unknown}, which are not module paths of the model")


def check_divide_factor(factor: object, process_groups: Mapping[str, Any]) -> None:
    """`gradient_divide_factor`: None, or a finite positive number given with
    `process_groups` (it divides those groups' gradients alone)."""
    if factor is None:
        return
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
        raise TypeError(
            f"gradient_divide_factor must be a number (the whole data-parallel world, say), "
            f"not {type(factor).__name__} {factor!r}"
        )
    if not math.isfinite(factor) or factor <= 0:
        raise ValueError(
            f"gradient_divide_factor must be a finite positive number, not {factor!r}: "
            "the summed gradients of the groups of process_groups are divided by it"
        )
    if not process_groups:
        raise ValueError(
            f"gradient_divide_factor={factor!r} divides the gradients of groups of their own, "
            "and no process_groups were given: pass it with process_groups (the rest of the "
            "model is averaged over its data-parallel group)"
        )


def check_evaluation_factor(factor: float | None) -> None:
    """Refuse `gradient_divide_factor` for a model initialized without an optimizer: such
    a model refuses backward, so no gradient is ever reduced and the factor divides
    nothing."""
    if factor is not None:
        raise ValueError(
            f"gradient_divide_factor={factor!r} divides the reduced gradients of groups of "
            "their own, and initialize() was given no optimizer (evaluation only: no "
            "gradient is reduced): drop the factor, or pass the optimizer"
        )


def param_group_index(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """For each parameter (by id), the index of its optimizer param group; the optimizer
    must be fresh and hold only parameters of `model`."""
    if len(optimizer.state) != 0:
        raise ValueError(
            "the optimizer already has state: build it fresh on the model's "
            "parameters and pass it to initialize() before any step"
        )
    model_params = {id(p) for p in model.parameters()}
    index: dict[int, int] = {}
    for k, pg in enumerate(optimizer.param_groups):
        for p in pg["params"]:
            if id(p) not in model_params:
                raise ValueError(
                    f"optimizer param group {k} holds a tensor of shape "
                    f"{tuple(p.shape)} that is not a parameter of the model"
                )
            index[id(p)] = k
    return index
