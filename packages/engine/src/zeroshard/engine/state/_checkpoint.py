"""`save_checkpoint` / `load_checkpoint`: the engine's state in zeroshard.ckpt's format.

Each flat group is stored under `group{index}` with its layout: the fp32 master shard
and every optimizer state tensor shaped like it (`optim.exp_avg`, ...); per-group
optimizer scalars (Adam's `step`) go into the metadata. Loading works at any world size:
`zeroshard.ckpt.load` reads each rank's new shard ranges straight from the files.

Parameters on a process group of their own (`initialize(..., process_groups=...)`,
experts) hold different values on different sets of ranks: their groups record those
sets (`GroupMeta.rank_sets`, ordered by first rank), and a rank loads the instance whose
place its own group has in the same order, at any size of that group.

The user's own state (`client_state`, `rank_state`) goes with it: see [Note: user state].
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.ckpt import (
    CheckpointError,
    CheckpointMeta,
    GroupMeta,
    GroupPlacement,
    LoadedShards,
    RankExtra,
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
from zeroshard.engine.runtime._names import canonical_name, named_parameters
from zeroshard.engine.runtime._state import EngineModel, EngineState, engine_module, engine_state
from zeroshard.engine.state._named_load import is_named_checkpoint, load_named
from zeroshard.engine.state._user_state import (
    GLOBAL,
    PER_RANK,
    check_requested,
    encode_state,
    restore,
    saved_scope,
)

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
        for name, p in named_parameters(model, remove_duplicate=False)
        if canonical.get(id(p), name) != name
    }


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    params = {id(p) for p in model.parameters()}
    return {
        canonical_name(k): v
        for k, v in model.state_dict(keep_vars=True).items()
        if id(v) not in params
    }


def save_checkpoint(
    model: EngineModel,
    optimizer: torch.optim.Optimizer,
    directory: str | os.PathLike[str],
    *,
    step: int,
    tag: str | None = None,
    async_save: bool = False,
    overwrite: bool = False,
    client_state: Mapping[str, Any] | None = None,
    rank_state: Mapping[str, Any] | None = None,
) -> SaveHandle | None:
    """Save model and optimizer as `directory/step-{step}` (or `/{tag}`); call on every rank.

    Atomic: a crash leaves the previous checkpoint intact. With `async_save` the files
    are written in the background and the returned handle's `wait()` (or the next save)
    commits them. `overwrite` replaces an existing checkpoint of that name. Under hybrid
    sharding only the first shard group writes (the others hold the same shards) and the
    others get None; a synchronous save returns on every rank only once committed.

    `client_state` is global state (the same on every rank: the scheduler), saved from
    rank 0; `rank_state` is each rank's own (`RNGState()`, its data position). Entries
    are `state_dict()` / `load_state_dict()` objects or plain data: see [Note: user
    state]. Both are snapshotted with the shards, so an async save keeps this step's.
    """
    model = engine_module(model)
    state = engine_state(model)
    if optimizer is not state.optimizer:
        raise ValueError("pass the optimizer returned by zeroshard.engine.initialize()")
    _refuse_rank_state_replicated(state, rank_state)
    # A delayed step in flight (delay_param_update) is part of this step's state.
    state.optimizer.settle()
    # Encoded on every rank, client_state too (only rank 0 stores it), so that bad input
    # fails on every rank alike, before any file is touched.
    # Labelled as the save's later agreements are (ckpt's `save of 'step-N': ...`); the
    # name is only formatted here, checked inside the agreed save below.
    name = tag if tag is not None else f"step-{step}"
    extra = agreed(
        state.shard_group,
        f"save of {name!r}: user state",
        lambda: encode_state({GLOBAL: client_state, PER_RANK: rank_state}),
    )
    if extra is not None and state.shard_group.rank != 0:
        extra = encode_state({PER_RANK: rank_state})
    writes = state.replicate is None or state.replicate.rank == 0
    handle = None
    if writes:
        handle = _save(model, state, directory, step, tag, async_save, overwrite, extra)
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
    extra: RankExtra | None,
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
        extra=extra,
    )


def _refuse_rank_state_replicated(state: EngineState, rank_state: Mapping[str, Any] | None) -> None:
    if rank_state is not None and state.replicate is not None:
        # Only the first replica writes files: the other replicas' own state has no place.
        raise ValueError(
            "rank_state is not supported under hybrid sharding (only the first replica "
            "saves files); keep per-rank state out of the checkpoint or use client_state"
        )


def _user_state(
    loaded: LoadedShards,
    rank: int,
    size: int,
    client_state: Mapping[str, Any] | None,
    rank_state: Mapping[str, Any] | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The saved global and per-rank entries asked for, checked (no side effects)."""
    where = f"checkpoint {loaded.path}"
    glob: dict[str, Any] = {}
    mine: dict[str, Any] = {}
    if client_state is not None:
        glob = saved_scope(loaded.extras.get(0), GLOBAL, where)
        check_requested(glob, client_state, f"{where}'s {GLOBAL}")
    if rank_state is not None:
        saved_size = loaded.meta.world_size
        if saved_size != size:
            raise CheckpointError(
                f"{where} was saved by {saved_size} ranks; this job has {size}: per-rank "
                f"state ({PER_RANK}: RNG states, data positions) cannot be given to another "
                f"number of ranks. Load without {PER_RANK} (and set it afresh) or at "
                f"{saved_size} ranks; the model, optimizer and {GLOBAL} load at any size"
            )
        mine = saved_scope(loaded.extras.get(rank), PER_RANK, f"{where} (rank {rank})")
        check_requested(mine, rank_state, f"{where}'s {PER_RANK} of rank {rank}")
    return glob, mine


@torch.no_grad()
def load_checkpoint(
    model: EngineModel,
    optimizer: torch.optim.Optimizer,
    directory: str | os.PathLike[str],
    *,
    tag: str | None = None,
    step: int | None = None,
    client_state: MutableMapping[str, Any] | None = None,
    rank_state: MutableMapping[str, Any] | None = None,
) -> int:
    """Restore model and optimizer from a checkpoint saved at any world size; return its step.

    `directory` is a checkpoint or the root holding `latest`, ours or DeepSpeed's ZeRO
    1/2/3 (docs/deepspeed.md). A checkpoint of another model (names or shapes) raises
    `zeroshard.ckpt.ModelMismatchError` listing the differences. Call on every rank.

    `client_state` / `rank_state` name the saved entries to restore, as saved by
    `save_checkpoint`: objects are loaded in place, plain data is put back into the
    mapping. `rank_state` loads only at the world size it was saved at (a clear error
    on every rank otherwise). Nothing is changed unless everything could be read.
    """
    model = engine_module(model)
    state = engine_state(model)
    if optimizer is not state.optimizer:
        raise ValueError("pass the optimizer returned by zeroshard.engine.initialize()")
    _refuse_rank_state_replicated(state, rank_state)
    # A delayed step in flight (delay_param_update) is part of this step's state.
    state.optimizer.settle()
    if is_named_checkpoint(Path(directory), tag, step):  # DeepSpeed's, or converted from it
        if client_state is not None or rank_state is not None:
            raise ValueError(
                "DeepSpeed (named) checkpoints keep their client state in pickles, which "
                "zeroshard does not load: pass neither client_state nor rank_state"
            )
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
    me, size = shard_group.rank, shard_group.size
    extras = {0} if client_state is not None else set()
    if rank_state is not None:
        extras.add(me)

    def read() -> tuple[LoadedShards, dict[str, Any], dict[str, Any]]:
        got = load(
            Path(directory),
            rank=me,
            world_size=size,
            tag=tag,
            step=step,
            expected=expected,
            layouts={_group_name(g): g.layout for g in state.groups},
            placements=placements,
            device=shard_group.device,
            extras=extras,
        )
        return (got, *_user_state(got, me, size, client_state, rank_state))

    # One outcome on every rank (a file bad on one rank fails the load everywhere).
    loaded, saved_global, saved_mine = agreed(
        shard_group, f"load_checkpoint({str(directory)!r})", read
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
    if client_state is not None or rank_state is not None:

        def put_back() -> None:
            restore(saved_global, client_state if client_state is not None else {})
            restore(saved_mine, rank_state if rank_state is not None else {})

        agreed(shard_group, f"load_checkpoint({str(directory)!r}): user state", put_back)
    return meta.step
