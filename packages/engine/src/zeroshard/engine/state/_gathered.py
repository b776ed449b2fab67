"""`gathered_parameters`: full fp32 parameters, readable and editable outside forward.

[Note: what the context holds]
For every flat group that holds a requested parameter, the master shards of all
ranks are all-gathered into one full fp32 buffer and the group's parameters become views
of it: inside the context a parameter holds the exact master value, not its compute-dtype
rounding, at every stage. The granularity is the flat group, so the buffer may hold more
parameters than were asked for (they are exposed too, read-only in spirit).

On exit with `modifier_rank`, that rank's buffer is broadcast, every rank copies its own
shard range back into the master, and the group publishes it (stages 1/2: an all-gather
into the compute-dtype `param_buffer`; stage 3: nothing, gathers read the master). Without
`modifier_rank` the buffer is simply dropped, so edits are discarded. The parameters are
then put back: stages 1/2 as views of `param_buffer`, stage 3 released (empty), the next
forward gathers them again.

Memory: one full fp32 copy of every touched group lives for the context's duration; it
is freed on exit, once `_restore` has pointed the parameters away from it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from zeroshard.comm import Handle, agreed, arrive
from zeroshard.engine.runtime._flat_group import FlatParamGroup, slot_views
from zeroshard.engine.runtime._home import refresh_homes
from zeroshard.engine.runtime._names import named_parameters
from zeroshard.engine.runtime._state import (
    EngineModel,
    EngineState,
    WrapsEngineModel,
    engine_module,
    engine_state,
)
from zeroshard.engine.runtime._tensor_parallel import point_at
from zeroshard.engine.runtime._unit import UnitState
from zeroshard.engine.runtime._wire import refresh_wires
from zeroshard.engine.state._masters import gather_masters

# Groups exposed by a live context (by id): a nested context over the same group would
# restore the parameters under the outer one's feet.
_ACTIVE: set[int] = set()


@dataclass(frozen=True)
class _Selection:
    """The groups to gather and the requested parameters' names (for errors)."""

    state: EngineState
    groups: tuple[FlatParamGroup, ...]


def _resolve(
    target: EngineModel | torch.Tensor | Iterable[torch.Tensor], model: EngineModel | None
) -> tuple[EngineState, list[tuple[str, torch.Tensor]]]:
    """The engine state and the requested (name, parameter) pairs, without duplicates."""
    if model is not None:
        model = engine_module(model)
    if isinstance(target, WrapsEngineModel):
        target = engine_module(target)
    named: list[tuple[str, torch.Tensor]]
    if isinstance(target, nn.Module):
        if model is None:
            try:
                engine_state(target)
            except ValueError:
                raise ValueError(
                    "gathered_parameters got a module that is not the initialized model: "
                    "pass the model too, as gathered_parameters(submodule, model=model)"
                ) from None
        owner = model if model is not None else target
        named = list(named_parameters(target))
    else:
        if model is None:
            raise ValueError(
                "gathered_parameters over parameters needs the initialized model: "
                "gathered_parameters(params, model=model)"
            )
        owner = model
        # A lone tensor is iterable (over its rows): take it as one parameter.
        items = [target] if isinstance(target, torch.Tensor) else list(target)
        names = {id(p): n for n, p in named_parameters(model)}
        seen: set[int] = set()
        named = []
        for i, p in enumerate(items):
            if not isinstance(p, torch.Tensor):
                raise ValueError(
                    f"gathered_parameters: item {i} is a {type(p).__name__}, not a parameter"
                )
            if id(p) not in seen:
                seen.add(id(p))
                named.append((names.get(id(p), f"<item {i}, shape {tuple(p.shape)}>"), p))
    return engine_state(owner), named


def _select(state: EngineState, named: list[tuple[str, torch.Tensor]]) -> _Selection:
    group_of = {id(p): g for g in state.groups for p in g.params}
    chosen: dict[int, FlatParamGroup] = {}
    unknown: list[str] = []
    for name, p in named:
        g = group_of.get(id(p))
        if g is None:
            unknown.append(name)
        else:
            chosen[g.index] = g
    if unknown:
        raise ValueError(
            f"gathered_parameters: {len(unknown)} parameter(s) are not managed by this "
            f"zeroshard engine: {unknown[:8]}{' ...' if len(unknown) > 8 else ''}"
        )
    busy = [g.index for g in chosen.values() if id(g) in _ACTIVE]
    if busy:
        raise ValueError(
            f"gathered_parameters: flat groups {busy} are already gathered by an enclosing "
            "gathered_parameters context; nest contexts over disjoint parameters only"
        )
    # state.groups order, the same on every rank, keeps the collectives matched.
    return _Selection(state, tuple(g for g in state.groups if g.index in chosen))


def _release_units(sel: _Selection) -> None:
    """Stage 3: drop gathered units touching the selection, through the units, so their
    states and the live-byte counters stay true while the context owns the groups."""
    runtime = sel.state.stage3
    if runtime is None:
        return
    wanted = {id(g) for g in sel.groups}
    for u in runtime.units:
        if u.state is not UnitState.RELEASED and any(id(g) in wanted for g in u.groups):
            u.release()


def _expose(g: FlatParamGroup, full: torch.Tensor) -> None:
    for p, v in zip(g.params, slot_views(full, g.layout), strict=True):
        point_at(p, v)  # a DTensor parameter: its local tensor, whole over dp


def _restore(sel: _Selection) -> None:
    """Put the parameters back as the engine keeps them between steps (no collective)."""
    # A forward inside the context (generate) gathers units again: release them through
    # the runtime, or it would believe them gathered over released parameters.
    _release_units(sel)
    for g in sel.groups:
        if g.sharded:
            g.release()  # stage 3: the unit is RELEASED in the runtime now
        else:
            g.expose()


def _check_unchanged(sel: _Selection, versions: list[int]) -> None:
    """RuntimeError if a master changed inside an editing block: the edits, made on the
    values from before, would be written over it (the step or load lost)."""
    changed = [g.index for g, v in zip(sel.groups, versions, strict=True) if g.master._version != v]
    if changed:
        raise RuntimeError(
            f"the masters of flat groups {changed} changed inside gathered_parameters("
            "modifier_rank=...) (optimizer.step(), a load): writing the block's edits back "
            "would undo that. Nothing was written back; step and load outside the block"
        )


def _write_back(sel: _Selection, fulls: list[torch.Tensor], modifier_rank: int) -> None:
    """Broadcast the modifier's buffers, copy each rank's range into its master, publish."""
    handles = [
        g.process_group.broadcast(full, modifier_rank, label=f"edits of group {g.index}")
        for g, full in zip(sel.groups, fulls, strict=True)
    ]
    for h in handles:
        h.wait()
    publishes: list[Handle] = []
    for g, full in zip(sel.groups, fulls, strict=True):
        lo, hi = g.shard_range
        g.master.detach().copy_(full[lo:hi])
        refresh_homes([g])
        refresh_wires([g])
        publishes.append(g.publish())
    # Stages 1/2: the parameters are restored as views of `param_buffer` only after this
    # wait, so nothing reads the buffer while the all-gather still writes it.
    for h in publishes:
        h.wait()


@contextlib.contextmanager
def gathered_parameters(
    module_or_params: EngineModel | torch.Tensor | Iterable[torch.Tensor],
    modifier_rank: int | None = None,
    *,
    model: EngineModel | None = None,
) -> Iterator[None]:
    """Make the full fp32 parameters readable (and editable) inside the block; collective.

    Pass the initialized model, or a submodule or parameters together with `model=`.
    Edits are kept only with `modifier_rank` (that rank's values win on every rank); they
    are discarded otherwise, and also when the block raises. See [Note: what the context holds].
    """
    state, named = _resolve(module_or_params, model)
    arrive(state.shard_group, "zs.gathered_parameters", "Enter it on every rank")
    # The masters of every step() so far, a delayed one (delay_param_update) included.
    state.settle()
    size = state.shard_group.size
    if modifier_rank is not None and state.tensor_parallel is not None:
        raise ValueError(
            "gathered_parameters: modifier_rank (edits) is not supported under tensor "
            "parallelism; read the parameters inside the block, or load_state_dict edits"
        )
    if modifier_rank is not None and not 0 <= modifier_rank < size:
        raise ValueError(
            f"gathered_parameters: modifier_rank {modifier_rank} is outside the "
            f"{size} ranks of the engine's group"
        )
    sel = _select(state, named)
    _release_units(sel)
    with torch.no_grad():
        fulls = gather_masters(sel.groups, "gathered")
        for g, full in zip(sel.groups, fulls, strict=True):
            _expose(g, full)
    _ACTIVE.update(id(g) for g in sel.groups)
    # Each master's version now: a step or a load inside the block writes them.
    versions = [g.master._version for g in sel.groups]
    completed = False
    try:
        yield
        completed = True
    finally:
        try:
            # A block that raised skips the broadcast: the other ranks may not have
            # raised, and a collective they never join would hang this rank instead.
            if completed and modifier_rank is not None:
                agreed(
                    state.shard_group,
                    "gathered_parameters(modifier_rank=...)",
                    lambda: _check_unchanged(sel, versions),
                )
                with torch.no_grad():
                    _write_back(sel, fulls, modifier_rank)
        finally:
            _restore(sel)
            _ACTIVE.difference_update(id(g) for g in sel.groups)
