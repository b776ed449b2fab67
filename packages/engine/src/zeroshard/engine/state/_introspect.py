"""Reading gradients and optimizer state: `full_grad`, `full_optimizer_state`, `grad_norms`.

[Note: when a gradient is readable]
The engine holds a parameter's gradient as pieces of its flat group's gradient shard
(`FlatParamGroup.grad_shard` on the device, or CPU offload's host gradient), in the
masters' dtype. These functions read it as DDP's `parameter.grad` holds it, at every
stage and under `zeroshard.compile`:

- from the end of a backward until `optimizer.zero_grad()`: the gradient accumulated over
  the window so far, averaged over the data-parallel ranks (stage 1 first reduces what
  backward accumulated, as `clip_grad_norm_` and `step()` do: read mid-window, the later
  micro-batches then add into the reduced shard rather than the compute-dtype buffer,
  the same sum up to that dtype's rounding);
- after `clip_grad_norm_`: clipped; after `step()`: the gradient the step used;
- under fp16 loss scaling: unscaled (the loss's own gradient) whether or not clipping or
  the step has unscaled the shards yet (`ZeroOptimizer.grad_scale`); an overflowing
  window's gradient holds its infs, and the step that skips it forgets it;
- none before a window's first backward, after `zero_grad()` (zeros with
  `set_to_none=False` where the gradient is on the device, as torch's), for a frozen
  parameter, and for an offloaded one stepped as its gradient landed under
  `step_in_backward()` in a window of one backward (its gradient is dropped once
  stepped, as torch's optimizer-in-backward drops `.grad`: [Note: offload host memory]
  in runtime/offload/_host_offload.py): `full_grad` gives None, `grad_norms` leaves it out.

An offloaded gradient is read on the host block by block, upcast with the clipping and
unscaling factors still pending on it (`GradDestination.read`), once the delayed step in
flight (`delay_param_update`) is done with the host's scratch.

A parameter's full value is assembled where it lies: each rank writes its shard's part
of the slot into a zero tensor of the parameter's size, and one all-reduce (a sum over
the group's ranks, each element held by one of them) leaves it whole on every rank, so
one parameter's worth moves rather than its flat group's; under tensor parallelism a
split parameter's pieces are then joined over tp. A parameter on a process group of its
own (experts) reads as this rank's instance of it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.comm import Agreement, Group, Handle
from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._host_norm import shard_norm
from zeroshard.engine.runtime._names import canonical_name, named_parameters
from zeroshard.engine.runtime._optimizer import ZeroOptimizer
from zeroshard.engine.runtime._state import EngineModel, EngineState, engine_module, engine_state
from zeroshard.engine.runtime._tensor_parallel import TensorParallel, own_path, split_dim


@dataclass(frozen=True)
class _Slot:
    """A parameter where its flat group holds it: slot `index` of `group`'s layout."""

    group: FlatParamGroup
    index: int

    @property
    def name(self) -> str:
        """The parameter's canonical name."""
        return self.group.names[self.index]


def _agreed_slot(
    state: EngineState, model: nn.Module, param: torch.Tensor | str, what: str
) -> _Slot:
    """The slot of `param` (a parameter of the model, or its name), the same on every rank:
    a ValueError on every rank when it is not the model's or the ranks asked for others."""
    where = {id(p): _Slot(g, i) for g in state.groups for i, p in enumerate(g.params)}
    if isinstance(param, str):
        named = dict(named_parameters(model, remove_duplicate=False))
        p = named.get(canonical_name(param))
        found = None if p is None else where.get(id(p))
        asked = repr(param)
    elif isinstance(param, torch.Tensor):
        found = where.get(id(param))
        asked = f"a tensor of shape {tuple(param.shape)}"
    else:
        raise ValueError(f"{what}: expected a parameter or its name, got {type(param).__name__}")
    described = found.name if found is not None else f"<not a parameter: {asked}>"
    Agreement(state.shard_group).check_same(
        [("parameter", described)],
        f"in {what}",
        f"{what}: which parameter",
        "every rank calls it with the same parameter",
    )
    if found is None:
        raise ValueError(
            f"{what}: {asked} is not a parameter this zeroshard engine holds (pass one of "
            "the initialized model's parameters, or its name as named_parameters() spells it)"
        )
    return found


def _gradients_ready(state: EngineState, call: str) -> ZeroOptimizer:
    """Every gradient of this window where the functions below read it: the delayed step
    done with the host's upcast, and stage 1's accumulated gradients reduced. The
    optimizer, which reduced them (a ValueError naming `call` without one)."""
    optimizer = state.needs_optimizer(call)
    optimizer.settle()
    optimizer.reducer.reduce_pending()
    return optimizer


def _assemble(
    slot: _Slot, pieces: Iterable[tuple[int, torch.Tensor]], dtype: torch.dtype, label: str
) -> torch.Tensor:
    """The slot's whole local tensor (its DTensor's local piece) over the group's ranks from
    each rank's `pieces` of its shard: (start in the shard, values). Collective."""
    g = slot.group
    s = g.layout.slots[slot.index]
    lo = g.shard_range[0]
    out = torch.zeros(s.numel, dtype=dtype, device=g.process_group.device)
    for start, values in pieces:
        a, b = max(s.offset, lo + start), min(s.end, lo + start + values.numel())
        if a < b:
            out[a - s.offset : b - s.offset].copy_(values[a - lo - start : b - lo - start])
    g.process_group.all_reduce(out, label=label).wait()
    return out.view(s.shape)


def _joined(tp: TensorParallel | None, slot: _Slot, local: torch.Tensor) -> torch.Tensor:
    """The full tensor of a parameter from its local tensor: a split one's pieces joined
    over tp (collective over tp), anything else as it is."""
    dim = split_dim(slot.group.params[slot.index])
    if tp is None or dim is None:
        return local
    gathered = torch.empty(tp.size * local.numel(), dtype=local.dtype, device=local.device)
    tp.group.all_gather_into(
        gathered, local.reshape(-1), label=f"tensor-parallel pieces of {slot.name}"
    ).wait()
    return torch.cat(gathered.view(tp.size, *local.shape).unbind(0), dim)


@torch.no_grad()
def full_grad(model: EngineModel, param: torch.Tensor | str) -> torch.Tensor | None:
    """`param`'s whole gradient (a parameter of the model, or its name) on every rank, on the
    engine's device in the masters' dtype; None where it holds none. Collective: every rank
    calls it with the same parameter. When it is readable: [Note: when a gradient is
    readable] in state/_introspect.py."""
    model = engine_module(model)
    state = engine_state(model)
    state.needs_optimizer("full_grad")
    slot = _agreed_slot(state, model, param, "full_grad")
    g = slot.group
    if not g.trainable:
        return None
    optimizer = _gradients_ready(state, "full_grad")
    if g.grad_shard is None:
        return None
    local = _assemble(slot, g.grads.read(g), g.master.dtype, f"gradient of {slot.name}")
    full = _joined(state.tensor_parallel, slot, local)
    scale = optimizer.grad_scale
    return full if scale == 1.0 else full.div_(scale)


@torch.no_grad()
def full_optimizer_state(model: EngineModel, param: torch.Tensor | str) -> dict[str, Any]:
    """`param`'s optimizer state as the plain optimizer's `state[param]` holds it, on every
    rank: each tensor of the parameter's shape whole (on the engine's device), the rest
    (Adam's `step`) as the optimizer keeps it; {} before the first step or for a frozen
    parameter. Collective: every rank calls it with the same parameter."""
    model = engine_module(model)
    state = engine_state(model)
    optimizer = state.needs_optimizer("full_optimizer_state")
    slot = _agreed_slot(state, model, param, "full_optimizer_state")
    g = slot.group
    # The state of every step() so far, a delayed one included.
    optimizer.settle()
    whole = state.whole_params
    if whole is not None and slot.name in whole.names:
        return _owner_state(state, slot)
    if not g.trainable:
        return {}
    out: dict[str, Any] = {}
    for key, value in optimizer.inner.state.get(g.master, {}).items():
        if isinstance(value, torch.Tensor) and value.shape == g.master.shape:
            local = _assemble(slot, [(0, value)], value.dtype, f"{key} of {slot.name}")
            out[key] = _joined(state.tensor_parallel, slot, local)
        elif isinstance(value, torch.Tensor) and value.numel() == 1:
            out[key] = value.detach().clone()
        elif isinstance(value, (int, float, bool)):
            out[key] = value
        else:
            raise ValueError(
                f"full_optimizer_state: state {key!r} of {slot.name!r} is a "
                f"{type(value).__name__} neither shaped like its shard nor a scalar"
            )
    return out


def _owner_state(state: EngineState, slot: _Slot) -> dict[str, Any]:
    """The state a whole-matrix optimizer keeps for `slot`'s whole parameter at its owner
    ([Note: whole parameters] in runtime/whole/_whole_step.py), broadcast from there."""
    assert state.whole_params is not None
    group = slot.group.process_group
    p = state.whole_params.owned.get(slot.name)
    kept = {} if p is None else state.needs_optimizer("full_optimizer_state").inner.state.get(p, {})
    # What the owner keeps (the others, None): every rank learns the owner and the shapes.
    mine = None
    if p is not None:
        mine = {
            k: (v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else v
            for k, v in kept.items()
        }
    everyone: list[dict[str, Any] | None] = [None] * group.size
    dist.all_gather_object(everyone, mine, group=group.pg)
    owner = next(r for r, held in enumerate(everyone) if held is not None)
    out: dict[str, Any] = {}
    for key, held in (everyone[owner] or {}).items():
        if not isinstance(held, tuple):
            out[key] = held
            continue
        dtype, shape = held
        if group.rank == owner:
            t = kept[key].detach().to(group.device, copy=True).contiguous()
        else:
            t = torch.empty(shape, dtype=dtype, device=group.device)
        group.broadcast(t, owner, label=f"{key} of {slot.name}").wait()
        out[key] = t
    return out


@torch.no_grad()
def grad_norms(model: EngineModel) -> dict[str, float]:
    """The 2-norm of every parameter's gradient by name (its canonical name, a tied one's
    once), without gathering any gradient: each rank sums the squares of its shard's part,
    one all-reduce per process group. Parameters holding no gradient are left out; a
    tensor-parallel one counts once ([Note: the clip norm under tensor parallelism]).
    Collective. What it reads, and when: [Note: when a gradient is readable]."""
    state = engine_state(model)
    optimizer = _gradients_ready(state, "grad_norms")
    tp = state.tensor_parallel
    held = [g for g in state.groups if g.trainable and g.grad_shard is not None]
    by_group: dict[int, tuple[Group, list[FlatParamGroup]]] = {}
    for g in held:
        # Under tp every rank adds into one sum, as the clip norm does; a group of its own
        # (an expert) over its group, then over tp (its pieces, one expert).
        own = own_path(g.key.process_group) is not None
        over = state.shard_group if tp is not None and not own else g.process_group
        by_group.setdefault(id(over.pg), (over, []))[1].append(g)
    sums: list[tuple[list[FlatParamGroup], torch.Tensor, Handle]] = []
    for over, groups in by_group.values():
        squares = torch.cat([_squares(g, tp) for g in groups])
        sums.append((groups, squares, over.all_reduce(squares, label="gradient norms")))
    scale = optimizer.grad_scale
    out: dict[str, float] = {}
    for groups, squares, handle in sums:
        handle.wait()
        if tp is not None and own_path(groups[0].key.process_group) is not None:
            tp.group.all_reduce(squares, label="gradient norms over tp").wait()
        norms = (squares.sqrt() / scale).tolist()
        names = [n for g in groups for n in g.names]
        out.update(zip(names, norms, strict=True))
    return out


def _squares(g: FlatParamGroup, tp: TensorParallel | None) -> torch.Tensor:
    """The sum of the squares of each of `g`'s parameters' elements in this rank's shard
    (fp32, one per slot); a parameter replicated over tp weighs 1/tp."""
    lo = g.shard_range[0]
    device = g.process_group.device
    out = torch.zeros(len(g.params), dtype=torch.float32, device=device)
    for start, values in g.grads.read(g):
        at = lo + start
        index, parts = [], []
        for i, s in enumerate(g.layout.slots):
            a, b = max(s.offset, at), min(s.end, at + values.numel())
            if a < b:
                index.append(i)
                parts.append(values[a - at : b - at])
        if parts:
            norms = torch.stack(_norms(parts)).to(device)
            out.index_add_(0, torch.tensor(index, device=device), norms.square())
    if tp is not None and not tp.is_split_group(g.key.process_group):
        out /= tp.size
    return out


def _norms(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """The fp32 2-norm of each part (all on one device); on the CPU on every core ([Note:
    host gradient norm])."""
    if parts[0].device.type == "cpu":
        return [shard_norm(p if p.dtype == torch.float32 else p.float()) for p in parts]
    return list(torch._foreach_norm(parts, 2, dtype=torch.float32))
