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
A group of its own there has an instance per expert and tp rank: its `expert_split`
names its split parameters and the tp size, so each expert consolidates whole and loads
at another tensor-parallel size (recut within the expert).

Under hybrid sharding the first replica writes the checkpoint, numbered over its ranks,
unless groups of their own cross the replicas (`EngineState.own_crosses_replicas`):
then every rank writes its file, numbered over the world (`file_group`); the other
groups are one set of the first replica's ranks, whose files alone hold them
(`writes`), and each group of its own is written by its ranks, once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
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
from zeroshard.comm import Group
from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._names import canonical_name, named_parameters
from zeroshard.engine.runtime._optimizers import class_path, stepped_by
from zeroshard.engine.runtime._state import EngineState
from zeroshard.engine.runtime._tensor_parallel import own_path, split_dim


def checkpoint_group_name(g: FlatParamGroup) -> str:
    """The name a flat group has in a checkpoint."""
    return f"group{g.index}"


RankSets = tuple[tuple[int, ...], ...]


def file_group(state: EngineState) -> Group:
    """The ranks whose files a checkpoint numbers and that write them: the shard group,
    or every rank where groups of their own cross the replicas."""
    if state.own_crosses_replicas:
        return Group(timeout=state.shard_group.timeout)
    return state.shard_group


def writes(state: EngineState, g: FlatParamGroup) -> bool:
    """Whether this rank writes `g`'s shards, where every rank writes a file (groups of
    their own crossing the replicas): a group of its own on every rank, another on the
    first replica's ranks (every replica holds the same)."""
    return own_path(g.key.process_group) is not None or _first_replica(state)


def _first_replica(state: EngineState) -> bool:
    """Whether this rank writes what every replica holds alike: on the first replica,
    or wherever only the first replica's ranks take part in a save."""
    crossing = state.own_crosses_replicas
    return not crossing or (state.replicate is not None and state.replicate.rank == 0)


def rank_sets(state: EngineState, objects: Group | None = None) -> dict[int, RankSets]:
    """For each flat group not on the file group (`file_group`): the ranks (the
    checkpoint's numbering) of every instance of it, ordered by first rank; under
    hybrid sharding beside groups of their own, the first replica's only. Collective
    over the file group when there are such groups (its objects gathered over `objects`:
    `checkpoint_contents`)."""
    files = file_group(state)
    own = [g for g in state.groups if g.process_group.pg is not files.pg]
    if not own:
        return {}
    files_pg = files.pg

    def numbered(global_rank: int) -> int:
        return global_rank if files_pg is None else dist.get_group_rank(files_pg, global_rank)

    mine = {
        g.index: tuple(
            numbered(g.process_group.global_rank(r)) for r in range(g.process_group.size)
        )
        for g in own
        if writes(state, g)
    }
    everyone: list[dict[int, tuple[int, ...]] | None] = [None] * files.size
    dist.all_gather_object(everyone, mine, group=(objects or files).pg)
    return {
        g.index: tuple(sorted({m[g.index] for m in everyone if m and g.index in m})) for g in own
    }


def tensor_split(state: EngineState, g: FlatParamGroup) -> TensorSplit | None:
    """How `g`'s instances cut its parameters under tensor parallelism (None without). A
    group of its own (an expert) has an instance per expert and tensor-parallel rank:
    each instance's pieces are stored as they are, not joined (None)."""
    if state.tensor_parallel is None or own_path(g.key.process_group) is not None:
        return None
    dims = {n: split_dim(p) for n, p in zip(g.names, g.params, strict=True)}
    return TensorSplit({n: d for n, d in dims.items() if d is not None})


def expert_split(state: EngineState, g: FlatParamGroup) -> TensorSplit | None:
    """How a group of its own (an expert) cuts its parameters under tensor parallelism:
    its instances are each expert's tp ranks in order (see `GroupMeta.expert_split`)."""
    if state.tensor_parallel is None or own_path(g.key.process_group) is None:
        return None
    dims = {n: split_dim(p) for n, p in zip(g.names, g.params, strict=True)}
    split = {n: d for n, d in dims.items() if d is not None}
    return TensorSplit(split, ranks=state.tensor_parallel.size)


def full_shapes(state: EngineState) -> dict[str, tuple[int, ...]]:
    """Every flat group's parameter name -> the shape of its whole tensor (a DTensor's
    global shape, not the local piece its slot holds; an expert's whole tensor)."""
    return {
        n: tuple(int(d) for d in (p.shape if split_dim(p) is not None else slot.shape))
        for g in state.groups
        for n, p, slot in zip(g.names, g.params, g.layout.slots, strict=True)
    }


def placements(state: EngineState) -> dict[str, GroupPlacement]:
    """Where this rank sits in each group on a process group of its own (collective). A
    rank of another replica than the first, in a group that replica alone writes, sits
    where its peer of the first replica does."""
    files = file_group(state)
    me = files.rank
    out = {}
    by_index = {g.index: g for g in state.groups}
    for index, sets in rank_sets(state).items():
        g = by_index[index]
        at = me
        if not writes(state, g):
            assert state.replicate is not None
            peer = state.replicate.global_rank(0)
            at = peer if files.pg is None else dist.get_group_rank(files.pg, peer)
        (instance,) = [i for i, ranks in enumerate(sets) if at in ranks]
        split = tensor_split(state, g) or expert_split(state, g)
        out[checkpoint_group_name(g)] = GroupPlacement(
            instance, len(sets), g.process_group.rank, split
        )
    return out


# What a scalar held as a tensor becomes in the metadata: its value (a snapshot defers it
# instead: [Note: scalars without a sync] in recovery/_scalars.py).
Scalar = Callable[[torch.Tensor], Any]


def item(t: torch.Tensor) -> Any:
    """The value of a one-element tensor (a host-device synchronization on CUDA)."""
    return t.item()


def _json_value(value: Any, scalar: Scalar) -> Any:
    if isinstance(value, tuple):
        return [_json_value(v, scalar) for v in value]
    if isinstance(value, torch.Tensor):
        return scalar(value)
    return value


def _split_state(
    g: FlatParamGroup, opt_state: Mapping[str, Any], scalar: Scalar
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The optimizer state of a master shard: shard-shaped tensors, and scalars (a
    tensor's as `scalar` makes it)."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for key, value in opt_state.items():
        if isinstance(value, torch.Tensor) and value.shape == g.master.shape:
            tensors[key] = value.detach()
        elif isinstance(value, torch.Tensor) and value.numel() == 1:
            scalars[key] = scalar(value)
        elif isinstance(value, (int, float, bool)):
            scalars[key] = value
        else:
            raise ValueError(
                f"optimizer state {key!r} of group {g.index} is a {type(value).__name__} "
                "that is neither shaped like the shard nor a scalar: cannot checkpoint it"
            )
    return tensors, scalars


def param_states(
    state: EngineState, *, every_shard: bool = False, objects: Group | None = None
) -> tuple[dict[str, ParamState], dict[str, torch.Tensor]]:
    """The whole-parameter optimizer state of every parameter a whole-matrix optimizer
    keeps it for (`EngineState.whole_params`): by name, each at the rank that owns it, and
    this rank's tensors of it; `every_shard`: this rank's own wherever it sits (a snapshot
    holds what its rank holds), recorded at this rank. Collective over the file group
    when there are any (its objects gathered over `objects`: `checkpoint_contents`)."""
    whole = state.whole_params
    if whole is None:
        return {}, {}
    inner = state.needs_optimizer("save_checkpoint").inner
    tensors: dict[str, torch.Tensor] = {}
    mine: dict[str, dict[str, Any]] = {}
    files = file_group(state)
    # Groups of their own are refused with these optimizers: what the others own is the
    # same on every replica, written by the first; under tp the same on every tp rank
    # ([Note: whole parameters under tensor parallelism]), written by the first.
    tp = state.tensor_parallel
    first = _first_replica(state) and (tp is None or tp.group.rank == 0)
    owned = whole.owned.items() if every_shard or first else ()
    for name, p in owned:
        kept: dict[str, Any] = {"tensors": {}, "scalars": {}}
        for key, value in inner.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                # Whether the step reads it on the device (offloaded state is kept on the
                # host between steps: [Note: whole parameters offloaded]).
                stepped_up = name in whole.on_host and value.dim() > 0
                on_device = p.device.type != "cpu" and (stepped_up or value.device == p.device)
                kept["tensors"][key] = (value.dtype, tuple(value.shape), on_device)
                tensors[param_state_key(name, key)] = value.detach()
            elif isinstance(value, (int, float, bool)):
                kept["scalars"][key] = value
            else:
                raise ValueError(
                    f"optimizer state {key!r} of {name!r} is a {type(value).__name__}, neither "
                    "a tensor nor a number: cannot checkpoint it"
                )
        mine[name] = kept
    everyone: list[dict[str, dict[str, Any]] | None] = [None] * files.size
    dist.all_gather_object(everyone, mine, group=(objects or files).pg)
    states = {
        name: ParamState(rank, kept["tensors"], kept["scalars"])
        for rank, owned in enumerate(everyone)
        for name, kept in (owned or {}).items()
    }
    # Several ranks hold the same state (replicas, tp ranks): each records its own.
    states.update({n: ParamState(files.rank, k["tensors"], k["scalars"]) for n, k in mine.items()})
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
    model: nn.Module,
    state: EngineState,
    *,
    every_shard: bool = False,
    scalar: Scalar = item,
    objects: Group | None = None,
) -> tuple[CheckpointMeta, dict[str, torch.Tensor]]:
    """This rank's checkpoint of the engine: the metadata and the tensors of its file
    (collective over the file group when there are groups on their own process group or
    a whole-matrix optimizer's state). `every_shard`: every group's shards this rank
    holds, those it does not write too (a snapshot holds the rank's whole state);
    `scalar`: what an optimizer scalar or hyperparameter held as a tensor becomes in the
    metadata (its value); `objects`: where the metadata's object gathers go, the file
    group's ranks in its order (None: the file group itself; a gloo twin under NCCL, whose
    `all_gather_object` would wait for the device: `recovery._contents.object_group`)."""
    optimizer = state.needs_optimizer("save_checkpoint")
    inner = optimizer.inner
    groups: list[GroupMeta] = []
    tensors: dict[str, torch.Tensor] = {}
    sets = rank_sets(state, objects)
    for g in state.groups:
        name = checkpoint_group_name(g)
        shard_tensors, scalars = _split_state(g, inner.state.get(g.master, {}), scalar)
        kinds = {MASTER: g.master.dtype}
        mine = {MASTER: g.master.detach()}
        for key, t in shard_tensors.items():
            kinds[OPTIM_PREFIX + key] = t.dtype
            mine[OPTIM_PREFIX + key] = t
        if every_shard or writes(state, g):
            tensors.update({shard_key(name, kind): t for kind, t in mine.items()})
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
                expert_split=expert_split(state, g),
            )
        )
    whole, whole_tensors = param_states(state, every_shard=every_shard, objects=objects)
    tensors.update(whole_tensors)
    buffers = module_buffers(model)
    files = file_group(state)
    if files.rank == 0:
        tensors.update({buffer_key(k): v.detach() for k, v in buffers.items()})
    scaler = optimizer.scaler
    meta = CheckpointMeta(
        world_size=files.size,
        groups=tuple(groups),
        stage=state.config.stage,
        compute_dtype=state.config.precision.compute_dtype,
        param_groups=tuple(
            {k: _json_value(v, scalar) for k, v in pg.items() if k != "params"}
            for pg in inner.param_groups
        ),
        tied=aliases(model, state),
        buffers=tuple(buffers),
        extra={"loss_scaler": None if scaler is None else scaler.state_dict()},
        param_states=whole,
        optimizers=tuple(class_path(o) for o in stepped_by(inner)),
    )
    return meta, tensors
