"""`save_checkpoint` / `load_checkpoint`: the engine's state in zeroshard.ckpt's format.

What goes where is `_checkpoint_layout`'s; loading works at any world size
(`zeroshard.ckpt.load` reads each rank's new shard ranges straight from the files) and
changes nothing unless everything could be read ([Note: all or nothing] in
`_checkpoint_apply`). Both calls first check that every rank passed the same arguments.
The user's own state (`client_state`, `rank_state`) goes with it: see [Note: user state].
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

import torch

from zeroshard.ckpt import (
    CHECKPOINT_ERRORS,
    MASTER,
    CheckpointError,
    GroupPlacement,
    LoadedShards,
    SaveHandle,
    checkpoint_step,
    is_dcp_checkpoint,
    load,
    save,
)
from zeroshard.comm import Agreement, Group, agreed, is_rank0
from zeroshard.engine.runtime._state import EngineModel, EngineState, engine_module, engine_state
from zeroshard.engine.runtime._tensor_parallel import own_path
from zeroshard.engine.state._checkpoint_apply import (
    apply_loaded,
    check_optimizer_structure,
    restore_user_state,
)
from zeroshard.engine.state._checkpoint_layout import (
    aliases,
    checkpoint_contents,
    checkpoint_group_name,
    file_group,
    full_shapes,
    module_buffers,
    placements,
)
from zeroshard.engine.state._named_load import RESUMED, is_named_checkpoint, load_named
from zeroshard.engine.state._user_state import (
    GLOBAL,
    PER_RANK,
    check_requested,
    encode_state,
    saved_scope,
)

log = logging.getLogger("zeroshard.engine")


def save_checkpoint(
    model: EngineModel,
    optimizer: torch.optim.Optimizer | None,
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
    A model initialized without an optimizer has no checkpoint to save (ValueError): its
    weights are `full_state_dict(model)`'s.
    """
    model = engine_module(model)
    state = engine_state(model)
    # A checkpoint is what a run resumes from: masters and optimizer state together.
    if optimizer is not state.needs_optimizer("save_checkpoint"):
        raise ValueError("pass the optimizer returned by zeroshard.engine.initialize()")
    everyone = every_rank(state)
    fields = [
        # One directory: rank 0 makes the folder every rank writes its file into.
        ("directory", os.path.abspath(directory)),
        *call_fields(tag, client_state, rank_state),
        ("step", _step_text(step)),
        ("async_save", str(bool(async_save))),
        ("overwrite", str(bool(overwrite))),
    ]
    # Labelled as the save's later agreements are (ckpt's `save of 'step-N': ...`); the
    # name is only formatted here, checked inside the agreed save below.
    name = tag if tag is not None else f"step-{step}"
    check_same_call(everyone, "save_checkpoint", f"save of {name!r}", fields)
    _refuse_rank_state_replicated(state, rank_state)
    # A delayed step in flight (delay_param_update) is part of this step's state.
    state.settle()
    # Encoded on every rank, client_state too (only rank 0 stores it), so that bad input
    # fails on every rank alike, before any file is touched.
    extra = agreed(
        everyone,
        f"save of {name!r}: user state",
        lambda: encode_state({GLOBAL: client_state, PER_RANK: rank_state}),
        CHECKPOINT_ERRORS,
    )
    files = file_group(state)
    if extra is not None and files.rank != 0:
        extra = encode_state({PER_RANK: rank_state})
    # Under hybrid sharding the first replica writes, or every rank where groups of their
    # own cross the replicas (see _checkpoint_layout.py).
    writes = state.replicate is None or state.replicate.rank == 0 or state.own_crosses_replicas
    handle = None
    if writes:
        meta, tensors = checkpoint_contents(model, state)
        handle = save(
            Path(directory),
            step,
            meta=meta,
            tensors=tensors,
            group=files,
            tag=tag,
            async_save=async_save,
            overwrite=overwrite,
            extra=extra,
        )
    if state.replicate is not None and not async_save:
        everyone.barrier(label="save_checkpoint: all replicas")
    return handle


def every_rank(state: EngineState) -> Group:
    """Every rank of the job: the shard group, or under hybrid sharding the world."""
    if state.replicate is None:
        return state.shard_group
    return Group(timeout=state.shard_group.timeout)


def _step_text(step: object) -> str:
    try:
        return str(checkpoint_step(step))
    except CheckpointError:  # refused by the save, on every rank alike
        return repr(step)


def call_fields(
    tag: str | None,
    client_state: Mapping[str, Any] | None,
    rank_state: Mapping[str, Any] | None,
) -> list[tuple[str, str]]:
    """The arguments of a save, load or resume that every rank must pass alike, as
    strings. A load's directory is not one of them (ranks may reach one checkpoint by
    different paths): what every rank read is compared instead (`_check_same_read`)."""

    def keys(entries: Mapping[str, Any] | None) -> str:
        return "None" if entries is None else repr(sorted(map(str, entries)))

    return [
        ("tag", repr(tag)),
        ("client_state", keys(client_state)),
        ("rank_state", keys(rank_state)),
    ]


def check_same_call(everyone: Group, call: str, label: str, fields: list[tuple[str, str]]) -> None:
    """The same ValueError on every rank, before anything else, if the ranks called
    `call` with different arguments (one rank's client_state only would leave the
    others waiting in a collective it never joins). `label` names the collective."""
    Agreement(everyone).check_same(
        fields,
        f"at {call}",
        f"{label}: arguments",
        f"Call {call} with the same arguments on every rank",
    )


def _check_same_read(everyone: Group, label: str, loaded: LoadedShards) -> None:
    """The same ValueError on every rank if they read different checkpoints (another
    step, other files), before anything is changed."""
    files = ",".join(f"{n}:{f.digest}" for n, f in sorted(loaded.meta.files.items()))
    Agreement(everyone).check_same(
        [("checkpoint", f"step {loaded.meta.step}, files {files}")],
        "at load_checkpoint",
        f"{label}: the checkpoint read",
        "Every rank must load one checkpoint",
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
    optimizer: torch.optim.Optimizer | None,
    directory: str | os.PathLike[str],
    *,
    tag: str | None = None,
    step: int | None = None,
    client_state: MutableMapping[str, Any] | None = None,
    rank_state: MutableMapping[str, Any] | None = None,
) -> int:
    """Restore model and optimizer from a checkpoint saved at any world size; return its step.

    `directory` is a checkpoint or the root holding `latest`, ours, DeepSpeed's ZeRO
    1/2/3 (docs/deepspeed.md) or a PyTorch DCP one of FSDP2 or torchtitan (or a root of
    `step-N` ones: docs/coming-from.md). A checkpoint of another model (names or shapes) raises
    `zeroshard.ckpt.ModelMismatchError` listing the differences. Call on every rank.

    `client_state` / `rank_state` name the saved entries to restore, as saved by
    `save_checkpoint`: objects are loaded in place, plain data is put back into the
    mapping. `rank_state` loads only at the world size it was saved at (a clear error
    on every rank otherwise). Nothing is changed unless everything could be read.

    A model initialized without an optimizer (`optimizer` None: evaluation only) loads the
    weights alone, from a checkpoint of any optimizer.
    """
    model = engine_module(model)
    state = engine_state(model)
    if optimizer is not state.optimizer:
        raise ValueError(
            "pass the optimizer returned by zeroshard.engine.initialize() (None where it "
            "was given none)"
        )
    everyone = every_rank(state)
    fields = [*call_fields(tag, client_state, rank_state), ("step", repr(step))]
    check_same_call(everyone, "load_checkpoint", f"load_checkpoint({str(directory)!r})", fields)
    _refuse_rank_state_replicated(state, rank_state)
    # A delayed step in flight (delay_param_update) is part of this step's state.
    state.settle()
    if is_named_checkpoint(Path(directory), tag, step):  # DeepSpeed's (or converted), DCP's
        if client_state is not None or rank_state is not None:
            raise ValueError(
                "DeepSpeed and DCP (named) checkpoints keep their client state in their own "
                "records, which zeroshard does not load: pass neither client_state nor "
                "rank_state"
            )
        # Under tensor parallelism every group is on the mesh's dp group, one instance
        # per tp rank: the pieces of one whole tensor, which a named checkpoint holds.
        if state.tensor_parallel is not None and is_dcp_checkpoint(directory, tag, step):
            raise ValueError(
                "a DCP checkpoint does not load under tensor parallelism (device_mesh) yet "
                "(DeepSpeed's does): load it without a mesh, save a zeroshard checkpoint, and "
                "load that one"
            )
        own = sorted(
            {n for g in state.groups if own_path(g.key.process_group) is not None for n in g.names}
        )
        if own and is_dcp_checkpoint(directory, tag, step):
            raise ValueError(
                f"parameters on a process group of their own ({own[:3]}...) hold a different "
                "value on each group (experts), while a DCP checkpoint holds one tensor per "
                "name: load them from a zeroshard or DeepSpeed MoE checkpoint"
            )
        if own and state.tensor_parallel is not None:
            raise ValueError(
                f"parameters on a process group of their own ({own[:3]}...) under tensor "
                "parallelism (device_mesh) do not load from a DeepSpeed checkpoint yet: load "
                "it without a mesh, save a zeroshard checkpoint, and load that one"
            )
        names = aliases(model, state)
        # Each group of its own loads its instance's experts (collective: before the read);
        # one over every rank of the checkpoint is its only instance.
        places = placements(state) if own else {}
        instances = {
            g.index: places.get(
                checkpoint_group_name(g), GroupPlacement(0, 1, g.process_group.rank)
            )
            for g in state.groups
            if own_path(g.key.process_group) is not None
        }
        return load_named(model, state, Path(directory), tag, step, names, everyone, instances)
    shard_group = file_group(state)
    places = placements(state)
    expected = full_shapes(state)
    expected.update({alias: expected[name] for alias, name in aliases(model, state).items()})
    buffers = module_buffers(model)
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
            layouts={checkpoint_group_name(g): g.layout for g in state.groups},
            placements=places,
            device=shard_group.device,
            extras=extras,
            param_states=sorted(state.whole_params.owned) if state.whole_params else (),
            # Without an optimizer the weights alone: its state is not even read.
            kinds=(MASTER,) if state.optimizer is None else None,
        )
        check_optimizer_structure(state, got)
        return (got, *_user_state(got, me, size, client_state, rank_state))

    # Read and check everything first, with one outcome on every rank (a file bad on one
    # rank fails the load everywhere); only then change anything.
    label = f"load_checkpoint({str(directory)!r})"
    loaded, saved_global, saved_mine = agreed(everyone, label, read, CHECKPOINT_ERRORS)
    _check_same_read(everyone, label, loaded)
    if client_state is not None or rank_state is not None:
        # The user's objects first: their own load_state_dict is the one part that can
        # fail as it is applied; then every rank puts them back as they were, and the
        # model and optimizer are not touched.
        restore_user_state(
            everyone,
            f"{label}: user state",
            [(saved_global, client_state or {}), (saved_mine, rank_state or {})],
        )
    apply_loaded(state, loaded, buffers)
    if is_rank0():
        log.info(RESUMED, loaded.path, loaded.meta.step, loaded.meta.world_size, size)
    return loaded.meta.step
