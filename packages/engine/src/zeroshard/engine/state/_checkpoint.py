"""`save_checkpoint` / `load_checkpoint`: the engine's state in zeroshard.ckpt's format.

Each flat group is stored under `group{index}` with its layout: the fp32 master shard
and every optimizer state tensor shaped like it (`optim.exp_avg`, ...); per-group
optimizer scalars (Adam's `step`) go into the metadata. Loading works at any world size:
`zeroshard.ckpt.load` reads each rank's new shard ranges straight from the files.

Parameters on a process group of their own (`initialize(..., process_groups=...)`,
experts) hold different values on different sets of ranks: their groups record those
sets (`GroupMeta.rank_sets`, ordered by first rank), and a rank loads the instance whose
place its own group has in the same order, at any size of that group.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.ckpt import (
    CheckpointMeta,
    GroupMeta,
    GroupPlacement,
    SaveHandle,
    buffer_key,
    load,
    save,
    shard_key,
)
from zeroshard.ckpt._agree import agreed
from zeroshard.ckpt._meta import MASTER
from zeroshard.comm import Group
from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._state import EngineModel, EngineState, engine_module, engine_state
from zeroshard.engine.state._named_load import is_named_checkpoint, load_named

_OPTIM = "optim."


def _group_name(g: FlatParamGroup) -> str:
    return f"group{g.index}"


RankSets = tuple[tuple[int, ...], ...]


def _rank_sets(state: EngineState) -> dict[int, RankSets]:
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


def _placements(state: EngineState) -> dict[str, GroupPlacement]:
    """Where this rank sits in each group on a process group of its own (collective)."""
    me = state.shard_group.rank
    out = {}
    by_index = {g.index: g for g in state.groups}
    for index, sets in _rank_sets(state).items():
        g = by_index[index]
        (instance,) = [i for i, ranks in enumerate(sets) if me in ranks]
        out[_group_name(g)] = GroupPlacement(instance, len(sets), g.process_group.rank)
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


def _aliases(model: nn.Module, state: EngineState) -> dict[str, str]:
    canonical = {id(p): n for g in state.groups for n, p in zip(g.names, g.params, strict=True)}
    return {
        name: canonical[id(p)]
        for name, p in model.named_parameters(remove_duplicate=False)
        if canonical.get(id(p), name) != name
    }


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    params = {id(p) for p in model.parameters()}
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if id(v) not in params}


def save_checkpoint(
    model: EngineModel,
    optimizer: torch.optim.Optimizer,
    directory: str | os.PathLike[str],
    *,
    step: int,
    tag: str | None = None,
    async_save: bool = False,
    overwrite: bool = False,
) -> SaveHandle | None:
    """Save model and optimizer as `directory/step-{step}` (or `/{tag}`); call on every rank.

    Atomic: a crash leaves the previous checkpoint intact. With `async_save` the files
    are written in the background and the returned handle's `wait()` (or the next save)
    commits them. `overwrite` replaces an existing checkpoint of that name. Under hybrid
    sharding only the first shard group writes (the others hold the same shards) and the
    others get None; a synchronous save returns on every rank only once committed.
    """
    model = engine_module(model)
    state = engine_state(model)
    if optimizer is not state.optimizer:
        raise ValueError("pass the optimizer returned by zeroshard.engine.initialize()")
    writes = state.replicate is None or state.replicate.rank == 0
    handle = _save(model, state, directory, step, tag, async_save, overwrite) if writes else None
    if state.replicate is not None and not async_save:
        Group(timeout=state.shard_group.timeout).barrier(label="save_checkpoint: all replicas")
    return handle


def _save(
    model: nn.Module,
    state: EngineState,
    directory: str | os.PathLike[str],
    step: int,
    tag: str | None,
    async_save: bool,
    overwrite: bool,
) -> SaveHandle:
    inner = state.optimizer.inner
    groups: list[GroupMeta] = []
    tensors: dict[str, torch.Tensor] = {}
    rank_sets = _rank_sets(state)
    for g in state.groups:
        name = _group_name(g)
        shard_tensors, scalars = _split_state(g, inner.state.get(g.master, {}))
        kinds = {MASTER: torch.float32}
        tensors[shard_key(name, MASTER)] = g.master.detach()
        for key, t in shard_tensors.items():
            kinds[_OPTIM + key] = t.dtype
            tensors[shard_key(name, _OPTIM + key)] = t
        groups.append(
            GroupMeta(
                name,
                g.layout,
                kinds,
                param_group=g.key.param_group if g.trainable else None,
                requires_grad=g.trainable,
                scalars=scalars,
                rank_sets=rank_sets.get(g.index),
            )
        )
    buffers = _buffers(model)
    if state.shard_group.rank == 0:
        tensors.update({buffer_key(k): v.detach() for k, v in buffers.items()})
    scaler = state.optimizer.scaler
    meta = CheckpointMeta(
        world_size=state.shard_group.size,
        groups=tuple(groups),
        stage=state.config.stage,
        compute_dtype=state.config.precision.compute_dtype,
        param_groups=tuple(
            {k: _json_value(v) for k, v in pg.items() if k != "params"} for pg in inner.param_groups
        ),
        tied=_aliases(model, state),
        buffers=tuple(buffers),
        extra={"loss_scaler": None if scaler is None else scaler.state_dict()},
    )
    return save(
        Path(directory),
        step,
        meta=meta,
        tensors=tensors,
        group=state.shard_group,
        tag=tag,
        async_save=async_save,
        overwrite=overwrite,
    )


@torch.no_grad()
def load_checkpoint(
    model: EngineModel,
    optimizer: torch.optim.Optimizer,
    directory: str | os.PathLike[str],
    *,
    tag: str | None = None,
    step: int | None = None,
) -> int:
    """Restore model and optimizer from a checkpoint saved at any world size; return its step.

    `directory` is a checkpoint or the root holding `latest`, ours or DeepSpeed's ZeRO
    1/2/3 (docs/deepspeed.md). A checkpoint of another model (names or shapes) raises
    `zeroshard.ckpt.ModelMismatchError` listing the differences. Call on every rank.
    """
    model = engine_module(model)
    state = engine_state(model)
    if optimizer is not state.optimizer:
        raise ValueError("pass the optimizer returned by zeroshard.engine.initialize()")
    if is_named_checkpoint(Path(directory), tag, step):  # DeepSpeed's, or converted from it
        own = sorted(
            {
                n
                for g in state.groups
                if g.process_group.pg is not state.shard_group.pg
                for n in g.names
            }
        )
        if own:
            # A named checkpoint holds one value per name: which instance would get it?
            raise ValueError(
                f"parameters on a process group of their own ({own[:3]}...) load from "
                "zeroshard checkpoints only, not from a DeepSpeed (named) one"
            )
        return load_named(model, state, Path(directory), tag, step, _aliases(model, state))
    shard_group = state.shard_group
    placements = _placements(state)
    expected = {
        n: tuple(int(d) for d in slot.shape)
        for g in state.groups
        for n, slot in zip(g.names, g.layout.slots, strict=True)
    }
    expected.update({alias: expected[name] for alias, name in _aliases(model, state).items()})
    buffers = _buffers(model)
    expected.update({k: tuple(v.shape) for k, v in buffers.items()})
    # One outcome on every rank (a file bad on one rank fails the load everywhere).
    loaded = agreed(
        shard_group,
        f"load_checkpoint({str(directory)!r})",
        lambda: load(
            Path(directory),
            rank=shard_group.rank,
            world_size=shard_group.size,
            tag=tag,
            step=step,
            expected=expected,
            layouts={_group_name(g): g.layout for g in state.groups},
            placements=placements,
            device=shard_group.device,
        ),
    )
    meta = loaded.meta
    inner = state.optimizer.inner
    for g in state.groups:
        name = _group_name(g)
        gm = loaded.sources[name]  # its kinds and scalars (the groups may be regrouped)
        g.master.copy_(loaded.shard(name, MASTER))
        if not g.trainable:
            continue
        opt_state: dict[str, Any] = {
            # Offloaded groups keep their optimizer state beside their master, on the host.
            k[len(_OPTIM) :]: loaded.shard(name, k).to(g.master.device, copy=True)
            for k in gm.shards
            if k.startswith(_OPTIM)
        }
        pg = inner.param_groups[g.key.param_group]
        on_device = bool(pg.get("fused") or pg.get("capturable"))
        for key, value in gm.scalars.items():
            # torch keeps Adam's step as a float32 tensor, on the device when fused.
            opt_state[key] = torch.tensor(
                float(value), dtype=torch.float32, device=g.master.device if on_device else "cpu"
            )
        inner.state[g.master] = opt_state
    if len(meta.param_groups) == len(inner.param_groups):
        for pg, saved in zip(inner.param_groups, meta.param_groups, strict=True):
            for key, value in saved.items():
                pg[key] = tuple(value) if isinstance(pg.get(key), tuple) else value
    for name, value in loaded.buffers.items():
        buffers[name].copy_(value)
    scaler_state = meta.extra.get("loss_scaler")
    if state.optimizer.scaler is not None and scaler_state is not None:
        state.optimizer.scaler.load_state_dict(scaler_state)
    state.optimizer.republish()
    return meta.step
