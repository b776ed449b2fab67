"""How the engine's state maps onto a checkpoint: group names, rank sets, contents.

Each flat group is stored under `group{index}` with its layout: the master shard
and every optimizer state tensor shaped like it (`optim.exp_avg`, ...); per-group
optimizer scalars (Adam's `step`) go into the metadata.

Parameters on a process group of their own (`initialize(..., process_groups=...)`,
experts) hold different values on different sets of ranks: their groups record those
sets (`GroupMeta.rank_sets`, ordered by first rank), and a rank loads the instance whose
place its own group has in the same order, at any size of that group.

Under tensor parallelism (`initialize(..., device_mesh=...)`) every group is such a
group, sharded over the mesh's `dp` ranks: instance k is tensor-parallel rank k, and
its `tensor_split` names the parameters whose pieces it holds (their dims), so the
checkpoint consolidates to the whole model and loads at another tensor-parallel size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.ckpt import (
    MASTER,
    OPTIM_PREFIX,
    CheckpointMeta,
    GroupMeta,
    GroupPlacement,
    ParamState,
    TensorSplit,
    buffer_key,
    param_state_key,
    shard_key,
)
from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._names import canonical_name, named_parameters
from zeroshard.engine.runtime._optimizers import class_path, stepped_by
from zeroshard.engine.runtime._state import EngineState
from zeroshard.engine.runtime._tensor_parallel import split_dim


def checkpoint_group_name(g: FlatParamGroup) -> str:
    """The name a flat group has in a checkpoint."""
    return f"group{g.index}"


RankSets = tuple[tuple[int, ...], ...]


def rank_sets(state: EngineState) -> dict[int, RankSets]:
    """For each flat group on a process group of its own: the ranks (of the shard group,
    the checkpoint's numbering) of every instance of it, ordered by first rank.
    Collective over the shard group when there are such groups."""
    own = [g for g in state.groups if g.process_group.pg is not state.shard_group.pg]
    if not own:
        return {}
    shard_pg = state.shard_group.pg

    def numbered(global_rank: int) -> int:
        return global_rank if shard_pg is None else dist.get_group_rank(shard_pg, global_rank)

    mine = {
        g.index: tuple(
            numbered(g.process_group.global_rank(r)) for r in range(g.process_group.size)
        )
        for g in own
    }
    everyone: list[dict[int, tuple[int, ...]] | None] = [None] * state.shard_group.size
    dist.all_gather_object(everyone, mine, group=shard_pg)
    return {g.index: tuple(sorted({m[g.index] for m in everyone if m})) for g in own}


def tensor_split(state: EngineState, g: FlatParamGroup) -> TensorSplit | None:
    """How `g`'s instances cut its parameters under tensor parallelism (None without)."""
    if state.tensor_parallel is None:
        return None
    dims = {n: split_dim(p) for n, p in zip(g.names, g.params, strict=True)}
    return TensorSplit({n: d for n, d in dims.items() if d is not None})


def full_shapes(state: EngineState) -> dict[str, tuple[int, ...]]:
    """Every flat group's parameter name -> the shape of its whole tensor (a DTensor's
    global shape, not the local piece its slot holds)."""
    return {
        n: tuple(int(d) for d in (p.shape if split_dim(p) is not None else slot.shape))
        for g in state.groups
        for n, p, slot in zip(g.names, g.params, g.layout.slots, strict=True)
    }


def placements(state: EngineState) -> dict[str, GroupPlacement]:
    """Where this rank sits in each group on a process group of its own (collective)."""
    me = state.shard_group.rank
    out = {}
    by_index = {g.index: g for g in state.groups}
    for index, sets in rank_sets(state).items():
        g = by_index[index]
        (instance,) = [i for i, ranks in enumerate(sets) if me in ranks]
        out[checkpoint_group_name(g)] = GroupPlacement(
            instance, len(sets), g.process_group.rank, tensor_split(state, g)
        )
    return out


def _json_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_json_value(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.item()
    return value


def _split_state(
    g: FlatParamGroup, opt_state: Mapping[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The optimizer state of a master shard: shard-shaped tensors, and scalars."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for key, value in opt_state.items():
        if isinstance(value, torch.Tensor) and value.shape == g.master.shape:
            tensors[key] = value.detach()
        elif isinstance(value, torch.Tensor) and value.numel() == 1:
            scalars[key] = value.item()
        elif isinstance(value, (int, float, bool)):
            scalars[key] = value
        else:
            raise ValueError(
                f"optimizer state {key!r} of group {g.index} is a {type(value).__name__} "
                "that is neither shaped like the shard nor a scalar: cannot checkpoint it"
            )
    return tensors, scalars


def param_states(state: EngineState) -> tuple[dict[str, ParamState], dict[str, torch.Tensor]]:
    """The whole-parameter optimizer state of every parameter a whole-matrix optimizer
    keeps it for (`EngineState.whole_params`): by name, each at the rank that owns it, and
    this rank's tensors of it. Collective over the shard group when there are any."""
    whole = state.whole_params
    if whole is None:
        return {}, {}
    inner = state.needs_optimizer("save_checkpoint").inner
    tensors: dict[str, torch.Tensor] = {}
    mine: dict[str, dict[str, Any]] = {}
    for name, p in whole.owned.items():
        kept: dict[str, Any] = {"tensors": {}, "scalars": {}}
        for key, value in inner.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                kept["tensors"][key] = (value.dtype, tuple(value.shape), value.device.type != "cpu")
                tensors[param_state_key(name, key)] = value.detach()
            elif isinstance(value, (int, float, bool)):
                kept["scalars"][key] = value
            else:
                raise ValueError(
                    f"optimizer state {key!r} of {name!r} is a {type(value).__name__}, neither "
                    "a tensor nor a number: cannot checkpoint it"
                )
        mine[name] = kept
    everyone: list[dict[str, dict[str, Any]] | None] = [None] * state.shard_group.size
    dist.all_gather_object(everyone, mine, group=state.shard_group.pg)
    states = {
        name: ParamState(rank, kept["tensors"], kept["scalars"])
        for rank, owned in enumerate(everyone)
        for name, kept in (owned or {}).items()
    }
    return states, tensors


def aliases(model: nn.Module, state: EngineState) -> dict[str, str]:
    """Each alias of a shared parameter -> the name its flat group holds it under."""
    canonical = {id(p): n for g in state.groups for n, p in zip(g.names, g.params, strict=True)}
    return {
        name: canonical[id(p)]
        for name, p in named_parameters(model, remove_duplicate=False)
        if canonical.get(id(p), name) != name
    }


def module_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state-dict buffers by canonical name."""
    params = {id(p) for p in model.parameters()}
    return {
        canonical_name(k): v
        for k, v in model.state_dict(keep_vars=True).items()
        if id(v) not in params
    }


def checkpoint_contents(
    model: nn.Module, state: EngineState
) -> tuple[CheckpointMeta, dict[str, torch.Tensor]]:
    """This rank's checkpoint of the engine: the metadata and the tensors of its file
    (collective over the shard group when there are groups on their own process group)."""
    optimizer = state.needs_optimizer("save_checkpoint")
    inner = optimizer.inner
    groups: list[GroupMeta] = []
    tensors: dict[str, torch.Tensor] = {}
    sets = rank_sets(state)
    for g in state.groups:
        name = checkpoint_group_name(g)
        shard_tensors, scalars = _split_state(g, inner.state.get(g.master, {}))
        kinds = {MASTER: g.master.dtype}
        tensors[shard_key(name, MASTER)] = g.master.detach()
        for key, t in shard_tensors.items():
            kinds[OPTIM_PREFIX + key] = t.dtype
            tensors[shard_key(name, OPTIM_PREFIX + key)] = t
        groups.append(
            GroupMeta(
                name,
                g.layout,
                kinds,
                param_group=g.key.param_group if g.trainable else None,
                requires_grad=g.trainable,
                scalars=scalars,
                rank_sets=sets.get(g.index),
                tensor_split=tensor_split(state, g),
            )
        )
    whole, whole_tensors = param_states(state)
    tensors.update(whole_tensors)
    buffers = module_buffers(model)
    if state.shard_group.rank == 0:
        tensors.update({buffer_key(k): v.detach() for k, v in buffers.items()})
    scaler = optimizer.scaler
    meta = CheckpointMeta(
        world_size=state.shard_group.size,
        groups=tuple(groups),
        stage=state.config.stage,
        compute_dtype=state.config.precision.compute_dtype,
        param_groups=tuple(
            {k: _json_value(v) for k, v in pg.items() if k != "params"} for pg in inner.param_groups
        ),
        tied=aliases(model, state),
        buffers=tuple(buffers),
        extra={"loss_scaler": None if scaler is None else scaler.state_dict()},
        param_states=whole,
        optimizers=tuple(class_path(o) for o in stepped_by(inner)),
    )
    return meta, tensors
