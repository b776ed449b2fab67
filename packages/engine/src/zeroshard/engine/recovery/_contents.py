"""What a rank's snapshot holds, and putting it back: the checkpoint's own definitions.

A snapshot holds exactly what `save_checkpoint` writes for the rank
(`checkpoint_contents`: masters, optimizer state and scalars, hyperparameters, loss
scale; the user's `client_state` and `rank_state` as `encode_state` encodes them), plus
the module buffers on every rank (a checkpoint keeps rank 0's only: a rank restored from
its own snapshot gets its own back). It is put back by the checkpoint's own phases
(`check_optimizer_structure`, `restore_user_state`, `apply_loaded`; [Note: all or
nothing]), so a restore from memory and a load from disk cannot differ in what they
restore.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeroshard.ckpt import (
    CheckpointError,
    CheckpointMeta,
    LoadedShards,
    RankExtra,
    buffer_key,
    param_state_key,
)
from zeroshard.comm import Group
from zeroshard.engine.recovery._file import Snapshot
from zeroshard.engine.runtime._state import EngineState
from zeroshard.engine.state._checkpoint_apply import (
    apply_loaded,
    check_optimizer_structure,
    restore_user_state,
)
from zeroshard.engine.state._checkpoint_layout import (
    checkpoint_contents,
    checkpoint_group_name,
    file_group,
    module_buffers,
)
from zeroshard.engine.state._user_state import (
    GLOBAL,
    PER_RANK,
    check_requested,
    encode_state,
    saved_scope,
)


def rank_contents(
    model: nn.Module,
    state: EngineState,
    step: int,
    client_state: Mapping[str, Any] | None,
    rank_state: Mapping[str, Any] | None,
) -> tuple[CheckpointMeta, dict[str, torch.Tensor], RankExtra | None]:
    """This rank's metadata, tensors (live, not copied) and user state at `step`
    (collective where `checkpoint_contents` is)."""
    meta, tensors = checkpoint_contents(model, state, every_shard=True)
    buffers = module_buffers(model)
    tensors.update({buffer_key(k): v.detach() for k, v in buffers.items()})
    meta = meta.with_files(step, {}, {k: tuple(v.shape) for k, v in buffers.items()})
    extra = encode_state({GLOBAL: client_state, PER_RANK: rank_state})
    return meta, tensors, extra


def _loaded(state: EngineState, snap: Snapshot, where: str) -> LoadedShards:
    """The snapshot as the checkpoint load's result, once it is checked to be of this
    engine (the same flat groups, layouts and optimizer structure)."""
    meta = snap.meta
    layouts = {checkpoint_group_name(g): g.layout for g in state.groups}
    saved = {g.name: g.layout for g in meta.groups}
    if saved != layouts:
        raise CheckpointError(
            f"{where} holds other flat groups than this model's ({sorted(saved)[:3]}... "
            f"vs {sorted(layouts)[:3]}...): a snapshot of another model or configuration"
        )
    me = file_group(state).rank  # the metadata's numbering
    whole = {
        name: {key: snap.tensors[param_state_key(name, key)] for key in ps.tensors}
        for name, ps in meta.param_states.items()
        if ps.rank == me
    }
    extras = {} if snap.extra is None else {me: snap.extra}
    sources = {g.name: g for g in meta.groups}
    loaded = LoadedShards(
        meta, Path(where), me, meta.world_size, layouts, snap.tensors, sources, extras, whole
    )
    check_optimizer_structure(state, loaded)
    return loaded


def check_snapshot(
    state: EngineState,
    snap: Snapshot,
    where: str,
    client_state: Mapping[str, Any] | None,
    rank_state: Mapping[str, Any] | None,
) -> tuple[LoadedShards, dict[str, Any], dict[str, Any]]:
    """Everything a restore needs, checked, with no side effect (CheckpointError)."""
    loaded = _loaded(state, snap, where)
    glob: dict[str, Any] = {}
    mine: dict[str, Any] = {}
    if client_state is not None:
        glob = saved_scope(snap.extra, GLOBAL, where)
        check_requested(glob, client_state, f"{where}'s {GLOBAL}")
    if rank_state is not None:
        mine = saved_scope(snap.extra, PER_RANK, where)
        check_requested(mine, rank_state, f"{where}'s {PER_RANK}")
    return loaded, glob, mine


def apply_snapshot(
    model: nn.Module,
    state: EngineState,
    everyone: Group,
    label: str,
    checked: tuple[LoadedShards, dict[str, Any], dict[str, Any]],
    client_state: MutableMapping[str, Any] | None,
    rank_state: MutableMapping[str, Any] | None,
) -> None:
    """Put a checked snapshot back, as `load_checkpoint` puts a checkpoint back."""
    loaded, glob, mine = checked
    if client_state is not None or rank_state is not None:
        restore_user_state(everyone, label, [(glob, client_state or {}), (mine, rank_state or {})])
    apply_loaded(state, loaded, module_buffers(model))
