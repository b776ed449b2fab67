"""What `load_checkpoint` does once every rank has read and checked a checkpoint.

[Note: all or nothing]
A load changes nothing unless it can change everything, on every rank. So it runs in
three phases, each ending in one agreed outcome: read and check everything (files,
names, shapes, the optimizer's structure, the user's entries: `check_optimizer_structure`
runs here); then give the user's own objects their state (`restore_user_state`), the one
part that can fail as it is applied (a `Stateful`'s `load_state_dict` is the user's
code), undone on every rank if it failed on any; then copy the model's and optimizer's
state in (`apply_loaded`), which only copies tensors already read.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import torch

from zeroshard.ckpt import (
    CHECKPOINT_ERRORS,
    MASTER,
    OPTIM_PREFIX,
    CheckpointError,
    CheckpointMeta,
    LoadedShards,
)
from zeroshard.comm import Group, agreed
from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._optimizers import class_path, stepped_by
from zeroshard.engine.runtime._state import EngineState
from zeroshard.engine.runtime.whole import host_state
from zeroshard.engine.state._checkpoint_layout import checkpoint_group_name
from zeroshard.engine.state._user_state import Stateful


def check_optimizer_structure(state: EngineState, loaded: LoadedShards) -> None:
    """CheckpointError naming what differs when the checkpoint's optimizer has other
    param groups than this one (their number, or which parameters are in which), as
    torch's own `load_state_dict` refuses them. A model initialized without an optimizer
    takes a checkpoint of any (it loads the weights only)."""
    if state.optimizer is None:
        return
    inner = state.optimizer.inner
    saved = loaded.meta.param_groups
    where = f"checkpoint {loaded.path}"
    if len(saved) != len(inner.param_groups):
        raise CheckpointError(
            f"{where} holds an optimizer with {len(saved)} param group(s), this optimizer "
            f"has {len(inner.param_groups)}: build it with the param groups it was saved with"
        )
    _check_optimizers(inner, loaded.meta, where)
    saved_group = {
        s.name: g.param_group for g in loaded.meta.groups if g.requires_grad for s in g.layout.slots
    }
    moved = [
        f"{n} (param group {saved_group[n]} there, {g.key.param_group} here)"
        for g in state.groups
        if g.trainable
        for n in g.names
        if n in saved_group and saved_group[n] != g.key.param_group
    ]
    if moved:
        shown = ", ".join(moved[:5]) + (f", ... ({len(moved)} in all)" if len(moved) > 5 else "")
        raise CheckpointError(f"{where} puts parameters in other param groups: {shown}")
    whole = frozenset() if state.whole_params is None else state.whole_params.names
    sharded = sorted(set(loaded.meta.param_states) - whole)
    if sharded:
        raise CheckpointError(
            f"{where} keeps whole-parameter optimizer state for {sharded[:5]}, which this "
            "run's optimizer keeps in shards: load it with the optimizer it was saved with"
        )


# What torch's LR schedulers add to a param group (not an optimizer's hyperparameters).
_SCHEDULER_KEYS = frozenset(
    {"initial_lr", "base_lr", "max_lr", "min_lr", "base_momentum", "max_momentum", "swa_lr"}
)


def _check_optimizers(inner: torch.optim.Optimizer, meta: CheckpointMeta, where: str) -> None:
    """CheckpointError when a saved param group was stepped by another optimizer than this
    run's same param group: its state and hyperparameters would be another algorithm's
    (Muon's momentum and lr under AdamW). The checkpoint's record names the class
    (format version 6); an older checkpoint's param group is another optimizer's when it
    has hyperparameters this one does not know while lacking some this one has."""
    owners = stepped_by(inner)
    differ = []
    for k, (owner, saved) in enumerate(zip(owners, meta.param_groups, strict=True)):
        here = class_path(owner)
        if meta.optimizers:
            # By class name: torch moves optimizers between modules (Muon: torch.optim._muon).
            there = meta.optimizers[k]
            if there.rsplit(".", 1)[-1] != here.rsplit(".", 1)[-1]:
                differ.append(f"param group {k}: {there} there, {here} here")
            continue
        foreign = sorted(set(saved) - set(inner.param_groups[k]) - _SCHEDULER_KEYS)
        lacking = sorted(set(owner.defaults) - set(saved))
        if foreign and lacking:
            differ.append(
                f"param group {k}: hyperparameters {foreign} there, which {here} lacks, "
                f"and not its {lacking}"
            )
    if differ:
        raise CheckpointError(
            f"{where} was saved with another optimizer ({'; '.join(differ[:5])}): load it "
            "into the optimizers it was saved with, in the same order and param groups (its "
            "state and hyperparameters are that algorithm's)"
        )


def restore_user_state(
    everyone: Group,
    label: str,
    pairs: Sequence[tuple[Mapping[str, Any], MutableMapping[str, Any]]],
) -> None:
    """Load each (saved, into) pair's entries (Stateful objects in place, plain data into
    the mapping) with one outcome on every rank: if any rank failed, every rank puts
    every entry back as it was and raises the same error. See [Note: all or nothing]."""
    undo: list[Callable[[], None]] = []

    def put_back() -> None:
        for saved, into in pairs:
            for key, target in list(into.items()):
                # The undo is taken first: a load_state_dict that raises may have
                # changed part of its object already.
                if isinstance(target, Stateful):
                    undo.append(_undo_load(target))
                    target.load_state_dict(saved[key])
                else:
                    undo.append(_undo_set(into, key))
                    into[key] = saved[key]

    try:
        agreed(everyone, label, put_back, CHECKPOINT_ERRORS)
    except CheckpointError as e:
        stuck = []
        for step in reversed(undo):
            try:
                step()
            except Exception as again:  # the agreed error stays the one raised
                stuck.append(repr(again))
        if stuck:
            raise type(e)(f"{e}; putting user state back failed too: {stuck}") from e
        raise


def _undo_load(target: Stateful) -> Callable[[], None]:
    before = copy.deepcopy(target.state_dict())
    return lambda: target.load_state_dict(before)


def _undo_set(into: MutableMapping[str, Any], key: str) -> Callable[[], None]:
    old = into[key]
    return lambda: into.__setitem__(key, old)


def apply_loaded(
    state: EngineState, loaded: LoadedShards, buffers: Mapping[str, torch.Tensor]
) -> None:
    """Copy a checked checkpoint's masters, optimizer state and hyperparameters, buffers
    and loss scale into the engine (without an optimizer: the masters and buffers), then
    republish the parameters."""
    if state.optimizer is None:
        _copy_weights(state, loaded, buffers)
        state.republish()
        return
    meta = loaded.meta
    optimizer = state.optimizer
    inner = optimizer.inner
    states: list[tuple[FlatParamGroup, dict[str, Any]]] = []
    # A declared whole-parameter optimizer steps the whole parameters, not the masters:
    # those are in no param group and get no state (torch's state_dict() would fail on
    # an entry it cannot number).
    bound = {id(p) for pg in inner.param_groups for p in pg["params"]}
    for g in state.groups:
        if not g.trainable or id(g.master) not in bound:
            continue
        name = checkpoint_group_name(g)
        gm = loaded.sources[name]  # its kinds and scalars (the groups may be regrouped)
        # State saved in the saved masters' dtype follows the masters into this run's
        # (a checkpoint of fp32 masters resumed with bf16 ones, or back): torch's
        # optimizers keep it in the parameter's dtype. Other state keeps its own.
        saved_master = gm.shards.get(MASTER)
        opt_state: dict[str, Any] = {
            # Offloaded groups keep their optimizer state beside their master, on the host.
            k[len(OPTIM_PREFIX) :]: loaded.shard(name, k).to(
                g.master.device,
                g.master.dtype if dtype == saved_master else dtype,
                copy=True,
            )
            for k, dtype in gm.shards.items()
            if k.startswith(OPTIM_PREFIX)
        }
        pg = inner.param_groups[g.key.param_group]
        on_device = bool(pg.get("fused") or pg.get("capturable"))
        for key, value in gm.scalars.items():
            # torch keeps Adam's step as a float32 tensor, on the device when fused.
            opt_state[key] = torch.tensor(
                float(value), dtype=torch.float32, device=g.master.device if on_device else "cpu"
            )
        states.append((g, opt_state))
    whole = state.whole_params
    owned = {} if whole is None else whole.owned
    whole_states = []
    for name, p in owned.items():
        saved_state = loaded.meta.param_states[name]
        kept: dict[str, Any] = dict(saved_state.scalars)
        for key, t in loaded.param_states[name].items():
            on_device = saved_state.tensors[key][2]
            # Offloaded state waits on the host for the step, pinned as the step keeps it
            # ([Note: whole parameters offloaded] in runtime/whole/_whole_step.py).
            if whole is not None and name in whole.on_host and t.dim():
                kept[key] = host_state(t, p.device, state.config.offload.pin_memory)
            else:
                kept[key] = t.to(p.device if on_device else "cpu", copy=True)
        whole_states.append((p, kept))
    # Every new tensor exists now (an allocation that fails has changed nothing): copy.
    _copy_weights(state, loaded, buffers)
    for g, opt_state in states:
        inner.state[g.master] = opt_state
    for p, kept in whole_states:
        inner.state[p] = kept
    put_hyperparameters(inner.param_groups, meta.param_groups)
    scaler_state = meta.extra.get("loss_scaler")
    if optimizer.scaler is not None and scaler_state is not None:
        optimizer.scaler.load_state_dict(scaler_state)
    state.republish()


def _copy_weights(
    state: EngineState, loaded: LoadedShards, buffers: Mapping[str, torch.Tensor]
) -> None:
    """The checkpoint's masters and buffers into the engine's."""
    for g in state.groups:
        g.master.copy_(loaded.shard(checkpoint_group_name(g), MASTER))
    for name, value in loaded.buffers.items():
        buffers[name].copy_(value)


def put_hyperparameters(
    param_groups: Sequence[MutableMapping[str, Any]], saved: Sequence[Mapping[str, Any]]
) -> None:
    """Put saved hyperparameters (JSON values) back, each in its present type: a tensor
    (a learning rate a scheduler keeps as one) filled in place, so the steps after keep
    its dtype's rounding as the uninterrupted run's; a tuple as a tuple."""
    for pg, values in zip(param_groups, saved, strict=True):
        for key, value in values.items():
            here = pg.get(key)
            if isinstance(here, torch.Tensor):
                here.fill_(value)
            else:
                pg[key] = tuple(value) if isinstance(here, tuple) else value
