"""What a rank's snapshot holds, and putting it back: the checkpoint's own definitions.

A snapshot holds exactly what `save_checkpoint` writes for the rank
(`checkpoint_contents`: masters, optimizer state and scalars, hyperparameters, loss
scale; the user's `client_state` and `rank_state` as `encode_state` encodes them), plus
the module buffers on every rank (a checkpoint keeps rank 0's only: a rank restored from
its own snapshot gets its own back). It is put back by the checkpoint's own phases
(`check_optimizer_structure`, `restore_user_state`, `apply_loaded`; [Note: all or
nothing]), so a restore from memory and a load from disk cannot differ in what they
restore.

[Note: a snapshot of a lagging run]
Under `offload.delay_param_update` the parameters forward computes with are one step
behind the masters from one `step()` to the next ([Note: delayed parameter update]). A
checkpoint keeps the masters only (a load publishes them: the resumed run computes its
first window without the lag). A snapshot is to resume as the run would have gone on, so
it also keeps this rank's shard of each trainable group's parameters as forward computes
with them (`ZeroOptimizer.behind`: compute dtype, one step behind), under `behind.` keys;
the restore publishes the masters as a load does, then all-gathers those shards over
the parameters and marks the optimizer lagging (`restore_lag`), so the next `step()`
publishes the masters first, as it would have. The step in flight is not part of it:
`take` waits for it (`settle`), and its masters are the snapshot's.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
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
    Scalar,
    checkpoint_contents,
    checkpoint_group_name,
    file_group,
    item,
    module_buffers,
)
from zeroshard.engine.state._user_state import (
    GLOBAL,
    PER_RANK,
    check_requested,
    encode_state,
    saved_scope,
)

# The parameters one step behind the masters ([Note: a snapshot of a lagging run]).
_BEHIND = "behind."


def rank_contents(
    model: nn.Module,
    state: EngineState,
    step: int,
    client_state: Mapping[str, Any] | None,
    rank_state: Mapping[str, Any] | None,
    scalar: Scalar = item,
    objects: Group | None = None,
) -> tuple[CheckpointMeta, dict[str, torch.Tensor], RankExtra | None]:
    """This rank's metadata (its tensor scalars as `scalar` makes them: their values,
    or a snapshot's placeholders), tensors (live, not copied) and user state at `step`
    (collective where `checkpoint_contents` is, its objects gathered over `objects`)."""
    meta, tensors = checkpoint_contents(
        model, state, every_shard=True, scalar=scalar, objects=objects
    )
    buffers = module_buffers(model)
    tensors.update({buffer_key(k): v.detach() for k, v in buffers.items()})
    meta = meta.with_files(step, {}, {k: tuple(v.shape) for k, v in buffers.items()})
    if state.optimizer is not None:
        groups = {g.index: g for g in state.groups}
        for index, shard in state.optimizer.behind().items():
            tensors[_BEHIND + checkpoint_group_name(groups[index])] = shard
    extra = encode_state({GLOBAL: client_state, PER_RANK: rank_state})
    return meta, tensors, extra


def object_group(state: EngineState, world: dist.ProcessGroup) -> Group:
    """A gloo group of the file group's ranks (`file_group`), numbered alike, for the
    object gathers of `checkpoint_contents` at `take`: over NCCL `all_gather_object`
    stages its bytes through the device and waits for it, which would cost `take` the
    host's lead ([Note: scalars without a sync] in _scalars.py). `world`: a gloo group of
    every rank, itself the twin where the file group is every rank. The file group
    itself where torch would number a twin's ranks otherwise (a new group numbers them
    by global rank). Collective over every rank."""
    files = file_group(state)
    mine = tuple(files.global_rank(r) for r in range(files.size))
    if mine == tuple(range(dist.get_world_size())):
        return Group(world, timeout=files.timeout)
    everyone: list[tuple[int, ...] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine, group=world)
    twin = None
    # Every rank makes every group, in the same order (`new_group` is collective).
    for ranks in sorted({r for r in everyone if r is not None}):
        pg = dist.new_group(list(ranks), backend="gloo", timeout=files.timeout)
        if ranks == mine:
            twin = pg
    if twin is None or list(mine) != sorted(mine):
        return files
    return Group(twin, timeout=files.timeout)


def _behind(state: EngineState, snap: Snapshot, where: str) -> dict[int, torch.Tensor]:
    """The snapshot's parameters one step behind its masters, by group index (empty
    where nothing lagged), once they are checked to fit this engine's groups."""
    held = {k[len(_BEHIND) :]: t for k, t in snap.tensors.items() if k.startswith(_BEHIND)}
    if not held:
        return {}
    out = {}
    for g in state.groups:
        if not g.trainable:
            continue
        t = held.pop(checkpoint_group_name(g), None)
        start, end = g.shard_range
        if t is None or t.dtype != g.param_buffer.dtype or t.shape != (end - start,):
            got = None if t is None else (t.dtype, tuple(t.shape))
            raise CheckpointError(
                f"{where} holds the parameters one step behind its masters, but not as "
                f"flat group {g.index}'s ({g.param_buffer.dtype}, {end - start} elements; "
                f"got {got})"
            )
        out[g.index] = t
    if held:
        raise CheckpointError(
            f"{where} holds lagging parameters of groups this engine does not train "
            f"({sorted(held)})"
        )
    return out


def _loaded(state: EngineState, snap: Snapshot, where: str) -> LoadedShards:
    """The snapshot as the checkpoint load's result, once it is checked to be of this
    engine (the same flat groups, layouts and optimizer structure)."""
    meta = snap.meta
    if meta is None:
        raise CheckpointError(f"{where} is a journal entry, not a full snapshot")
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


class Checked(NamedTuple):
    """A snapshot checked to fit this engine: the checkpoint load's result, the user's
    global and per-rank state, the parameters one step behind (`_behind`)."""

    loaded: LoadedShards
    glob: dict[str, Any]
    mine: dict[str, Any]
    behind: dict[int, torch.Tensor]


def check_snapshot(
    state: EngineState,
    snap: Snapshot,
    where: str,
    client_state: Mapping[str, Any] | None,
    rank_state: Mapping[str, Any] | None,
) -> Checked:
    """Everything a restore needs, checked, with no side effect (CheckpointError)."""
    loaded = _loaded(state, snap, where)
    behind = _behind(state, snap, where)
    glob, mine = checked_user_state(snap, where, client_state, rank_state)
    return Checked(loaded, glob, mine, behind)


def checked_user_state(
    snap: Snapshot,
    where: str,
    client_state: Mapping[str, Any] | None,
    rank_state: Mapping[str, Any] | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The user's saved `client_state` and `rank_state` of a snapshot or journal entry,
    each checked to hold what the mappings ask for ({} where one is None)."""
    glob: dict[str, Any] = {}
    mine: dict[str, Any] = {}
    if client_state is not None:
        glob = saved_scope(snap.extra, GLOBAL, where)
        check_requested(glob, client_state, f"{where}'s {GLOBAL}")
    if rank_state is not None:
        mine = saved_scope(snap.extra, PER_RANK, where)
        check_requested(mine, rank_state, f"{where}'s {PER_RANK}")
    return glob, mine


def apply_snapshot(
    model: nn.Module,
    state: EngineState,
    everyone: Group,
    label: str,
    checked: Checked,
    client_state: MutableMapping[str, Any] | None,
    rank_state: MutableMapping[str, Any] | None,
) -> None:
    """Put a checked snapshot back, as `load_checkpoint` puts a checkpoint back, and the
    lag of the parameters behind the masters ([Note: a snapshot of a lagging run])."""
    loaded, glob, mine, behind = checked
    if client_state is not None or rank_state is not None:
        restore_user_state(everyone, label, [(glob, client_state or {}), (mine, rank_state or {})])
    apply_loaded(state, loaded, module_buffers(model))
    # Every rank lagged or none did: their snapshots are of one step() of one run.
    if behind:
        state.needs_optimizer("Snapshots.resume").restore_lag(behind)
