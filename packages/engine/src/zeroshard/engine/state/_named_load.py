"""Resume from a `NamedTrainingState` (a DeepSpeed ZeRO or PyTorch DCP checkpoint) at any
world size.

Each rank fills its own master shard and optimizer state shard slot by slot: for every
parameter slice in the shard it reads the same elements of that parameter's tensors in
the checkpoint (`RangeSpec.read_range`), so no rank reads or holds more than its shard.
Everything is read and checked (`read_named_shards`) before anything changes
(`apply_named_shards`), as `zeroshard.ckpt.load` does for our own checkpoints.
Hyperparameters (lr, betas, eps, weight_decay...) are taken from the checkpoint's
param groups, as DeepSpeed's and FSDP2's own resumes restore them; implementation switches
(foreach, fused, capturable, differentiable) stay the user's.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeroshard.ckpt import (
    CHECKPOINT_ERRORS,
    GroupPlacement,
    ModelMismatchError,
    NamedTrainingState,
    RangeSpec,
    check_names_shapes,
    is_converted_checkpoint,
    is_dcp_checkpoint,
    is_deepspeed_checkpoint,
    read_dcp_training_state,
    read_deepspeed_training_state,
    read_named_state,
)
from zeroshard.comm import Group, agreed
from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._names import canonical_name, named_buffers
from zeroshard.engine.runtime._optimizers import CombinedOptimizer
from zeroshard.engine.runtime._state import EngineState
from zeroshard.engine.runtime._tensor_parallel import full_runs
from zeroshard.engine.runtime.whole import split_muon
from zeroshard.engine.state._checkpoint_layout import full_shapes

log = logging.getLogger("zeroshard.engine")
# The one line a resume logs on rank 0, whichever format it read: path, step and world sizes.
RESUMED = "resumed from %s at step %d (world size %d then, %d now)"

# State keys torch's Adam/AdamW keep per parameter (step is a scalar).
_ADAM_STATE = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"})
# torch's and DeepSpeed's Muon's momentum, per parameter.
MUON_MOMENTUM = "momentum_buffer"
# param_groups entries that choose an implementation, not the mathematics: the user's.
_IMPLEMENTATION = frozenset({"foreach", "fused", "capturable", "differentiable"})


def _fill(g: FlatParamGroup, specs: Mapping[str, RangeSpec], out: torch.Tensor) -> None:
    """Fill `out` (this rank's shard of `g`, on the CPU) from per-parameter specs of whole
    tensors (a parameter split over tp reads its piece's runs of the whole tensor)."""
    out.zero_()  # alignment padding stays zero, as in a fresh shard
    params = dict(zip(g.names, g.params, strict=True))
    for slot, piece in g.layout.slots_in_shard(g.process_group.rank):
        runs = full_runs(params[slot.name], slot.shape, piece.slot_start, piece.numel)
        for whole, local, n in runs:
            at = piece.shard_start + local - piece.slot_start
            specs[slot.name].read_range(whole, out[at : at + n])


def _source_names(
    state: EngineState,
    named: NamedTrainingState,
    canonical: Mapping[str, str],
    instances: Mapping[int, GroupPlacement],
) -> dict[int, dict[str, str]]:
    """Each flat group's parameter names -> the names the checkpoint holds their values
    under: a parameter on a process group of its own (an expert, `instances`: its group's
    place) takes the value of its instance, the expert-parallel rank of a DeepSpeed MoE
    checkpoint (its expert's global name); every other, the one value of its name."""
    out: dict[int, dict[str, str]] = {}
    for g in state.groups:
        placed = instances.get(g.index)
        names = {}
        for n in g.names:
            name = canonical.get(n, n)
            per = named.experts.get(name, (name,))
            if placed is None and len(per) > 1:
                raise ModelMismatchError(
                    f"{named.source} holds {name!r} once per expert-parallel rank ({len(per)}), "
                    "an expert, but your model holds one value of it: give its module a "
                    "process group of its own (initialize(..., process_groups=...))"
                )
            if placed is not None and name not in named.experts:
                raise ModelMismatchError(
                    f"{name!r} is on a process group of its own (an expert: a value per "
                    f"group), but {named.source} holds one value of it: load it from a "
                    "zeroshard checkpoint or a DeepSpeed MoE one with its expert files"
                )
            if placed is not None and len(per) != placed.instances:
                raise ModelMismatchError(
                    f"{named.source} holds {name!r} on {len(per)} expert-parallel ranks, your "
                    f"model on {placed.instances} groups of its own: give it as many"
                )
            names[n] = per[0] if placed is None else per[placed.instance]
        out[g.index] = names
    return out


def _check_names(
    model: nn.Module, state: EngineState, named: NamedTrainingState, aliases: Mapping[str, str]
) -> None:
    # An expert's other instances (its global names past the first) are not model names.
    others = {name for per in named.experts.values() for name in per[1:]}
    have = {n: s.shape for n, s in named.masters.items() if n not in others}
    have.update({a: named.masters[c].shape for a, c in named.aliases.items() if c in named.masters})
    have.update({n: s.shape for n, s in named.buffers.items()})
    expected = full_shapes(state)
    expected.update({a: expected[c] for a, c in aliases.items()})
    # keep_vars: the keys alone; at stage 3 a plain state_dict() would gather every
    # parameter whole on every rank (collective, the full model in memory) just to name them.
    persistent = {canonical_name(k) for k in model.state_dict(keep_vars=True)}
    params = {id(p) for p in model.parameters()}
    for name, b in named_buffers(model):
        if name in persistent and id(b) not in params:
            expected[name] = tuple(b.shape)
    check_names_shapes(have, expected, named.source)


def _owner(inner: torch.optim.Optimizer, k: int) -> torch.optim.Optimizer:
    """The optimizer that steps param group `k` of `inner` (one of several, combined)."""
    if not isinstance(inner, CombinedOptimizer):
        return inner
    first = inner.offsets()
    return inner.optimizers[bisect.bisect_right(first, k) - 1]


def _held(named: NamedTrainingState, names: set[str]) -> tuple[set[str], bool]:
    """The optimizer state keys the checkpoint holds for `names` (tensors and scalars of
    the param groups they are in), and whether those groups are DeepSpeed Muon's."""
    groups = [pg for pg in named.param_groups if names & set(pg.names)]
    keys = {k for k, specs in named.optimizer_state.items() if names & specs.keys()}
    keys |= {k for pg in groups for k in pg.scalars}
    return keys, any(pg.hyperparameters.get("use_muon") for pg in groups)


def _check_optimizer(
    inner: torch.optim.Optimizer, named: NamedTrainingState, trained: Mapping[int, set[str]]
) -> None:
    """Each of our param groups that trains (`trained`: its parameters' names in the
    checkpoint) gets the checkpoint's state of its parameters in the optimizer that owns
    it, one optimizer or several: Adam's into an Adam or AdamW, DeepSpeed Muon's momentum
    into torch.optim.Muon."""
    for k, names in sorted(trained.items()):
        keys, muon = _held(named, names)
        owner = _owner(inner, k)
        where = "" if owner is inner else f" (param group {k}'s optimizer)"
        if not keys:
            continue  # nothing saved for them: their state starts afresh
        if muon and keys == {MUON_MOMENTUM}:
            if not split_muon(owner):
                raise ValueError(
                    f"{named.source} holds DeepSpeed Muon's momentum for {sorted(names)[:3]}, "
                    f"but your optimizer is {type(owner).__name__}{where}: give them "
                    "torch.optim.Muon to resume it"
                )
            continue
        if muon and MUON_MOMENTUM in keys:
            raise ModelMismatchError(
                f"{named.source}: your param group {k} ({sorted(names)[:3]}...) holds "
                "parameters DeepSpeed's Muon stepped and parameters its Adam stepped: give "
                "the Muon ones torch.optim.Muon and the rest Adam or AdamW"
            )
        unknown = sorted(keys - _ADAM_STATE)
        if unknown:
            raise ValueError(
                f"{named.source}: optimizer state {unknown} is not Adam's (exp_avg, "
                "exp_avg_sq, step) nor DeepSpeed Muon's (momentum_buffer): only those are "
                "carried over by name (a DeepSpeed optimizer without a torch.optim "
                "counterpart, SGD's momentum...), so it cannot be"
            )
        if not isinstance(owner, (torch.optim.Adam, torch.optim.AdamW)):
            raise ValueError(
                f"{named.source} holds Adam state ({sorted(keys)}), but your optimizer is "
                f"{type(owner).__name__}{where}: wrap torch.optim.AdamW (or Adam) to resume it"
            )


def _group_of(
    state: EngineState, named: NamedTrainingState, canonical: Mapping[str, str]
) -> dict[int, int]:
    """Our param group index -> the checkpoint's, checked to hold the same parameters
    (none for a checkpoint without optimizer: the optimizer starts afresh)."""
    if not named.param_groups:
        return {}
    ours: dict[int, set[str]] = {}
    for g in state.groups:
        if g.trainable:
            ours.setdefault(g.key.param_group, set()).update(canonical.get(n, n) for n in g.names)
    theirs = [{canonical.get(n, n) for n in pg.names} for pg in named.param_groups]
    mapping = {}
    for k, names in sorted(ours.items()):
        match = [i for i, t in enumerate(theirs) if names <= t]
        if len(match) != 1:
            raise ModelMismatchError(
                f"{named.source}: your optimizer's param group {k} ({sorted(names)[:4]}...) "
                "is not one of the checkpoint's param groups "
                f"({[sorted(t)[:4] for t in theirs]}): build the param groups as the "
                "run that saved it did"
            )
        mapping[k] = match[0]
    return mapping


def _hyperparameters(
    inner: torch.optim.Optimizer, named: NamedTrainingState, mapping: Mapping[int, int]
) -> list[str]:
    """Set each param group's hyperparameters from the checkpoint; describe what changed."""
    notes = []
    for k, i in mapping.items():
        pg, saved = inner.param_groups[k], named.param_groups[i].hyperparameters
        for key, value in saved.items():
            if key in _IMPLEMENTATION:
                continue
            if key not in pg:
                notes.append(f"group {k}: {key}={value!r} (your optimizer has no such setting)")
                continue
            value = tuple(value) if isinstance(pg[key], tuple) else value
            if pg[key] != value:
                notes.append(f"group {k}: {key} {pg[key]!r} -> {value!r} (from the checkpoint)")
                pg[key] = value
    return notes


@dataclass
class NamedShards:
    """What this rank reads before anything is changed: its shards and the buffers."""

    masters: dict[int, torch.Tensor] = field(default_factory=dict)
    optimizer_state: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    mapping: dict[int, int] = field(default_factory=dict)


def read_named_shards(
    model: nn.Module,
    state: EngineState,
    named: NamedTrainingState,
    aliases: Mapping[str, str],
    instances: Mapping[int, GroupPlacement],
) -> NamedShards:
    """Check the checkpoint against model and optimizer, and read this rank's shards of it
    (on the host; no collective, nothing changed yet, so a failure leaves the run as it was).

    `aliases` maps the model's tied parameter names to the canonical ones of its groups;
    `instances` each group of its own (by index) to its place (`_source_names`).
    """
    _check_names(model, state, named, aliases)
    canonical = dict(named.aliases)
    sources = _source_names(state, named, canonical, instances)
    if state.optimizer is None:  # evaluation only: the weights alone
        out = NamedShards(mapping={})
    else:
        trained: dict[int, set[str]] = {}
        for g in state.groups:
            if g.trainable:
                names = {canonical.get(n, n) for n in g.names}
                trained.setdefault(g.key.param_group, set()).update(names)
        _check_optimizer(state.optimizer.inner, named, trained)
        out = NamedShards(mapping=_group_of(state, named, canonical))
    for g in state.groups:
        # The masters and their optimizer state in the run's master dtype, as saved
        # in fp32 or not (torch's optimizers keep their state in the parameter's dtype).
        source = sources[g.index]
        host = torch.empty(g.master.numel(), dtype=g.master.dtype)
        _fill(g, {n: named.masters[source[n]] for n in g.names}, host)
        out.masters[g.index] = host
        if not g.trainable or state.optimizer is None:
            continue
        opt_state = {}
        for key, specs in named.optimizer_state.items():
            if source[g.names[0]] not in specs:
                continue  # another optimizer's state (Muon's momentum, its Adam's moments)
            host = torch.empty(g.master.numel(), dtype=g.master.dtype)
            _fill(g, {n: specs[source[n]] for n in g.names}, host)
            opt_state[key] = host
        out.optimizer_state[g.index] = opt_state
    buffers = dict(named_buffers(model))
    for name, spec in named.buffers.items():
        if name in buffers:
            host = torch.empty(spec.numel, dtype=spec.dtype)
            spec.read(host)
            out.buffers[name] = host.view(spec.shape)
    return out


@torch.no_grad()
def apply_named_shards(
    model: nn.Module, state: EngineState, named: NamedTrainingState, shards: NamedShards
) -> int:
    """Install what `read_named_shards` read, then republish the parameters (collective);
    return the checkpoint's step."""
    optimizer = state.optimizer
    for g in state.groups:
        g.master.copy_(shards.masters[g.index])
        if not g.trainable or optimizer is None:
            continue
        inner = optimizer.inner
        if g.key.param_group not in shards.mapping:
            inner.state.pop(g.master, None)  # no optimizer state saved: it starts afresh
            continue
        # Offloaded groups keep their optimizer state beside their master, on the host.
        opt_state: dict[str, Any] = {
            k: v.to(g.master.device, copy=True) for k, v in shards.optimizer_state[g.index].items()
        }
        pg = inner.param_groups[g.key.param_group]
        on_device = bool(pg.get("fused") or pg.get("capturable"))
        for key, value in named.param_groups[shards.mapping[g.key.param_group]].scalars.items():
            # torch keeps Adam's step as a float32 tensor, on the device when fused.
            device = g.master.device if on_device else torch.device("cpu")
            opt_state[key] = torch.tensor(value, dtype=torch.float32, device=device)
        inner.state[g.master] = opt_state
    notes = [] if optimizer is None else _hyperparameters(optimizer.inner, named, shards.mapping)
    buffers = dict(named_buffers(model))
    for name, loaded in shards.buffers.items():
        buffers[name].copy_(loaded)
    dropped = list(named.not_carried)
    scaler = None if optimizer is None else optimizer.scaler
    if scaler is not None and named.loss_scale is not None:
        scaler.load_state_dict(
            {"scale": named.loss_scale.scale, "good_steps": named.loss_scale.good_steps}
        )
    elif named.loss_scale is not None and optimizer is not None:
        dropped.append("the fp16 loss scale (this run does not compute in fp16)")
    state.republish()
    if state.shard_group.rank == 0:
        log.info(RESUMED, named.source, named.step, named.world_size, state.shard_group.size)
        for note in notes:
            log.warning("hyperparameter taken from the checkpoint: %s", note)
        for what in dropped:
            log.warning("not carried over from %s: %s", named.source, what)
    return named.step


def is_named_checkpoint(path: Path, tag: str | None, step: int | None) -> bool:
    """Whether `path` is read by parameter name: DeepSpeed's, converted from DeepSpeed, or
    PyTorch DCP's (FSDP2, torchtitan)."""
    return (
        is_deepspeed_checkpoint(path)
        or is_converted_checkpoint(path, tag, step)
        or is_dcp_checkpoint(path, tag, step)
    )


def load_named(
    model: nn.Module,
    state: EngineState,
    path: Path,
    tag: str | None,
    step: int | None,
    aliases: Mapping[str, str],
    everyone: Group,
    instances: Mapping[int, GroupPlacement],
) -> int:
    """`load_checkpoint` of a DeepSpeed, converted or DCP checkpoint (`step=N`:
    `global_stepN`, DCP's `step-N`); `everyone` is every rank of the job (under hybrid
    sharding, every replica too); `instances` places each group of its own (experts)."""

    def read() -> tuple[NamedTrainingState, NamedShards]:
        if is_deepspeed_checkpoint(path):
            ds_tag = tag if step is None else f"global_step{step}"
            named = read_deepspeed_training_state(path, ds_tag)
        elif is_dcp_checkpoint(path, tag, step):
            named = read_dcp_training_state(path, tag=tag, step=step, buffers=buffer_names)
        else:
            named = read_named_state(path, tag, step)
        return named, read_named_shards(model, state, named, aliases, instances)

    # DCP does not say which of its tensors are buffers: the model's persistent ones.
    persistent = {canonical_name(k) for k in model.state_dict(keep_vars=True)}
    buffer_names = {n for n, _ in named_buffers(model) if n in persistent}
    # One outcome on every rank (a file bad on one rank fails the load everywhere), and
    # nothing is changed unless every rank read its shards.
    named, shards = agreed(everyone, f"load_checkpoint({str(path)!r})", read, CHECKPOINT_ERRORS)
    return apply_named_shards(model, state, named, shards)
