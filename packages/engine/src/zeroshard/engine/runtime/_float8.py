"""torchao's float8 training in the engine: which weights ask for the fp8 gather, and
their parameters made plain again.

A model converted by torchao's `convert_to_float8_training` holds `Float8Linear`
modules, which cast their input and weight to fp8 in every forward and backward. With
`Float8LinearConfig(enable_fsdp_float8_all_gather=True)` torchao also wraps each such
weight in a tensor subclass (`WeightWithDynamicFloat8CastTensor`) whose hooks FSDP2
calls to gather it in fp8. zeroshard gathers those weights in fp8 itself
(`_float8_gather.py`) and needs no subclass: `unwrap_float8_weights` gives each module
its plain parameter back before anything is flattened (the subclass has no storage of
its own, which is what flattening and the checks before it read), and checkpoints then
hold plain weights under the module's own names. Under tensor parallelism the subclass
is the DTensor's local tensor: the DTensor stays, its local tensor becomes plain.

torchao is an optional dependency: nothing here imports it unless the model's modules
come from it (torchao is then imported already). It ships no type information, so its
objects are `Any` here.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zeroshard.engine.config._config import ZeroConfig

_LINEAR = "torchao.float8.float8_linear"
_SUBCLASS = "torchao.float8.fsdp_utils"


@dataclass(frozen=True, eq=False)
class Float8Weight:
    """A `Float8Linear`'s weight that its config asks to gather in fp8."""

    module: nn.Module  # the torchao Float8Linear holding it as `weight`
    dtype: torch.dtype  # its fp8 dtype (cast_config_weight.target_dtype)
    mm_config: Any  # torchao's LinearMMConfig: how its scaled matmuls run
    round_scales_to_power_of_2: bool

    @property
    def parameter(self) -> nn.Parameter:
        """The (plain) weight parameter."""
        p = self.module._parameters["weight"]
        assert isinstance(p, nn.Parameter)
        return p


def _float8_linears(model: nn.Module) -> Iterator[tuple[str, Any]]:
    linear = sys.modules.get(_LINEAR)
    if linear is None:  # torchao.float8 never imported: no module can come from it
        return
    for name, module in model.named_modules():
        if isinstance(module, linear.Float8Linear):
            yield name, module


def _is_wrapped(p: Any) -> bool:
    utils = sys.modules.get(_SUBCLASS)
    return utils is not None and isinstance(p, utils.WeightWithDynamicFloat8CastTensor)


def unwrap_float8_weights(
    model: nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()
) -> None:
    """Replace every torchao fp8-gather weight subclass in `model` (and in the param groups
    of `optimizers`) by the plain parameter it wraps."""
    swapped: dict[int, nn.Parameter] = {}
    for _, module in _float8_linears(model):
        wrapped: Any = module._parameters.get("weight")
        local: Any = getattr(wrapped, "_local_tensor", None)
        if _is_wrapped(local):
            # Tensor parallelism put the subclass inside the DTensor (torch's
            # `distribute_tensor` of the wrapped weight): the DTensor parameter stays,
            # its local piece becomes the plain tensor the subclass holds.
            wrapped._local_tensor = local._tensor.detach()
            continue
        if not _is_wrapped(wrapped):
            continue
        plain = swapped.get(id(wrapped))
        if plain is None:
            inner = wrapped._tensor
            # torchao wraps the original parameter; after a `.to()` it wraps a copy.
            if isinstance(inner, nn.Parameter) and not _is_wrapped(inner):
                plain = inner
            else:
                plain = nn.Parameter(inner.detach(), requires_grad=wrapped.requires_grad)
            plain.requires_grad_(wrapped.requires_grad)
            swapped[id(wrapped)] = plain
        module._parameters["weight"] = plain
    for pg in (pg for o in optimizers for pg in o.param_groups):
        pg["params"] = [swapped.get(id(p), p) for p in pg["params"]]


def float8_weights(model: nn.Module) -> dict[int, Float8Weight]:
    """id(weight) -> its `Float8Weight`, for every `Float8Linear` of `model` whose config
    sets `enable_fsdp_float8_all_gather` and whose weight no other module uses (a tied
    weight is read as a plain tensor there, so it is gathered in the compute dtype).
    Empty when torchao is not imported."""
    found: dict[int, Float8Weight] = {}
    for _, module in _float8_linears(model):
        config = module.config
        if not config.enable_fsdp_float8_all_gather:
            continue
        p = module._parameters.get("weight")
        if p is None:
            continue
        found[id(p)] = Float8Weight(
            module,
            config.cast_config_weight.target_dtype,
            module.linear_mm_config,
            bool(config.round_scales_to_power_of_2),
        )
    holders: dict[int, int] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None and id(p) in found:
                holders[id(p)] = holders.get(id(p), 0) + 1
    return {k: w for k, w in found.items() if holders.get(k) == 1}


def one_float8_dtype(weights: Mapping[int, Float8Weight]) -> torch.dtype:
    """The one fp8 dtype of `weights` (non-empty); two or more are refused by name, as
    torchao's own scale precomputation takes one."""
    dtypes = {w.dtype for w in weights.values()}
    if len(dtypes) != 1:
        raise ValueError(
            f"enable_fsdp_float8_all_gather: the fp8 weights use {len(dtypes)} fp8 dtypes "
            f"({sorted(map(str, dtypes))}); zeroshard gathers them in one"
        )
    (dtype,) = dtypes
    return dtype


def gathered_in_float8(model: nn.Module, cfg: ZeroConfig) -> dict[int, Float8Weight]:
    """The fp8 weights of `model` that `cfg` gathers in fp8: at stage 3, wherever their
    masters live (an offloaded group's wire casts the compute shard its home keeps on the
    device: [Note: home and wire]). Stages 1/2 keep the weights whole in the compute dtype
    between steps (each `Float8Linear` casts its own, as without the option). Their dtypes
    are checked here, at any world size: a model refused on eight GPUs is refused on one,
    where it would gather in the compute dtype."""
    if cfg.stage != 3:
        return {}
    weights = float8_weights(model)
    if weights:
        one_float8_dtype(weights)
    return weights
