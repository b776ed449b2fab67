"""`model.state_dict()` and `model.load_state_dict()` on the engine's model, as on the original.

[Note: state dicts of a sharded model]
Stage 3 keeps only master shards, so torch's own `state_dict()` would return empty
tensors and `load_state_dict()` of full tensors would fail on their shapes. Hooks on the
model make both behave as on the module before `initialize()`:

- `state_dict()` gives every parameter the value of its master in the parameter's
  original dtype, at every stage, under its names (tied parameters share one tensor):
  what the module before `initialize()` would hold, and what `save_pretrained` should
  write (FSDP2's full state dict does the same). Stage 3 all-gathers the masters one flat
  group at a time, so it is collective: call it on every rank. At stages 1/2 the
  parameters are whole on every rank in the compute dtype: where that is each
  parameter's own dtype and no delayed step runs behind them (`delay_param_update`), they
  hold exactly those values and torch's own state dict is kept, with no collective (the
  DDP habit `if rank == 0: torch.save(model.state_dict(), path)` works there); in mixed
  precision the masters are gathered as at stage 3, a collective. Inside
  `state_dict_on_rank0(model)` only rank 0 keeps the values, on the CPU; the other ranks
  get an empty dict (FSDP's full state dict with `rank0_only` and `offload_to_cpu`).
  `state_dict(keep_vars=True)` returns the live (sharded) parameters, untouched.
- `load_state_dict(full)` (every stage) copies each rank's range of every full tensor into
  the masters and republishes them (stages 1/2: the parameters; stage 3: the next
  gather reads the masters), so the masters follow and the next step starts from the
  loaded values. It is collective too; every rank passes the whole dict.

`state_dict()` of a submodule at stage 3 cannot see the other ranks' shards without the
model's engine: it raises an error naming `zs.full_state_dict`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zeroshard.comm import arrive, is_rank0
from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._state import EngineModel, EngineState, engine_module
from zeroshard.engine.runtime._tensor_parallel import is_dtensor, like_param, local_piece
from zeroshard.engine.state._masters import gather_masters
from zeroshard.partition import Slot

_MODE_ATTR = "_zeroshard_state_dict_mode"
GUIDANCE = "call state_dict() on the model returned by initialize(), or zs.full_state_dict(model)"


@dataclass
class _Mode:
    """What `state_dict()` of one model produces, and whether the model's call is under way."""

    rank0_only: bool = False
    in_root: bool = False


def install_state_dict_hooks(model: nn.Module, state: EngineState) -> None:
    """Register the hooks of [Note: state dicts of a sharded model] on the engine's model."""
    mode = _Mode()
    setattr(model, _MODE_ATTR, mode)
    # Keys the load pre-hook copied into the masters, for the post-hook.
    taken: set[str] = set()

    def pre_save(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        mode.in_root = True

    def post_save(
        module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
    ) -> None:
        mode.in_root = False
        _fill_full(state, module, state_dict, prefix, mode)

    def pre_load(
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        if local_metadata.get("assign_to_params_buffers", False):
            raise ValueError(
                "load_state_dict(assign=True) would replace the engine's sharded parameters; "
                "load without assign (values are copied into the shards)"
            )
        # A delayed step in flight (delay_param_update) must not write over what is loaded.
        state.settle()
        taken.update(_scatter(state, module, state_dict, prefix, error_msgs))

    def post_load(module: nn.Module, incompatible: Any) -> None:
        # The pre-hook took the parameters' keys out so that torch would not copy them
        # into the (sharded) parameters; they were loaded, not missing.
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in taken]
        taken.clear()

    # The registration functions are untyped in torch.
    model.register_state_dict_pre_hook(pre_save)  # type: ignore[no-untyped-call]
    model.register_state_dict_post_hook(post_save)  # type: ignore[no-untyped-call]
    model.register_load_state_dict_pre_hook(pre_load)  # type: ignore[no-untyped-call]
    model.register_load_state_dict_post_hook(post_load)  # type: ignore[no-untyped-call]
    if state.stage3 is not None:
        owners = {id(p) for g in state.groups for p in g.params}
        for sub in model.modules():
            if sub is not model and any(id(p) in owners for p in sub._parameters.values()):
                guard = _submodule_guard(mode)
                sub.register_state_dict_post_hook(guard)  # type: ignore[no-untyped-call]


def _submodule_guard(mode: _Mode) -> Any:
    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, meta: Any) -> None:
        if not mode.in_root:
            raise RuntimeError(
                f"state_dict() of submodule {type(module).__name__} holds stage-3 shards, "
                f"not full tensors; {GUIDANCE}"
            )

    return hook


@contextlib.contextmanager
def state_dict_on_rank0(model: EngineModel) -> Iterator[None]:
    """Inside, `model.state_dict()` gathers the full values to rank 0 only, on the CPU.

    The other ranks still take part in the gathers and get an empty dict.
    """
    mode = getattr(engine_module(model), _MODE_ATTR, None)
    if not isinstance(mode, _Mode):
        raise ValueError("this model was not initialized with zeroshard.engine.initialize()")
    # Nested blocks: the outer one's mode holds again after the inner one.
    outer, mode.rank0_only = mode.rank0_only, True
    try:
        yield
    finally:
        mode.rank0_only = outer


def _names_by_param(module: nn.Module, prefix: str) -> dict[int, list[str]]:
    """Every state-dict key of each parameter (tied ones have several)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def _fill_full(
    state: EngineState, module: nn.Module, state_dict: dict[str, Any], prefix: str, mode: _Mode
) -> None:
    names = _names_by_param(module, prefix)
    if any(isinstance(state_dict.get(n), nn.Parameter) for ns in names.values() for n in ns):
        return  # keep_vars=True asks for the live parameters themselves
    # Rank 0 of the job (under hybrid sharding every shard group has a rank 0 of its own).
    keep = not mode.rank0_only or is_rank0()
    tp = state.tensor_parallel
    # On rank 0 alone, a parameter split by tensor parallelism is joined whole.
    join = tp is not None and mode.rank0_only
    if join or not _parameters_hold_masters(state):
        # Before the first gather: the DDP habit (rank 0 alone) fails in seconds.
        arrive(
            state.shard_group,
            "model.state_dict()",
            "It gathers every flat group (stage 3, or masters in another dtype than the "
            "parameters): call it on every rank. To keep the values on rank 0 only (the DDP "
            "habit `if rank == 0: torch.save(model.state_dict(), path)`), call it on every "
            "rank inside `with zs.state_dict_on_rank0(model):`; the other ranks get {}",
        )
        state.settle()  # the masters of every step() so far
        for g in state.groups:  # the same order on every rank keeps the gathers matched
            (full,) = gather_masters([g], "state_dict")
            values = [full[s.offset : s.end].view(s.shape) for s in g.layout.slots]
            if join and tp is not None and tp.is_split_group(g.key.process_group):
                values = tp.full_values(full, g.layout, g.params)
            if keep:
                for p, value in zip(g.params, values, strict=True):
                    value = value.to(
                        "cpu" if mode.rank0_only else value.device, g.key.dtype, copy=True
                    )
                    if not join:  # a DTensor parameter's value is a DTensor, as before
                        value = like_param(p, value)
                    for n in names.get(id(p), []):
                        state_dict[n] = value
            del full, values  # one group's full buffer at a time
    if not keep:
        state_dict.clear()
    elif mode.rank0_only:
        for k, v in state_dict.items():
            if isinstance(v, torch.Tensor):
                state_dict[k] = v.detach().cpu()


def _parameters_hold_masters(state: EngineState) -> bool:
    """Stages 1/2: whether every parameter holds its master's value in its own dtype (the
    publish casts each master to the compute dtype after every step), so `state_dict()`
    can read the parameters instead of gathering the masters."""
    cfg = state.config
    return (
        state.stage3 is None
        and not cfg.offload.delay_param_update
        and all(g.key.dtype == cfg.precision.compute_dtype for g in state.groups)
    )


@torch.no_grad()
def _scatter(
    state: EngineState,
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    error_msgs: list[str],
) -> set[str]:
    """Copy this rank's range of each full parameter into the masters; return the keys taken."""
    names = _names_by_param(module, prefix)
    taken: set[str] = set()
    copies: list[tuple[FlatParamGroup, Slot, torch.Tensor]] = []
    for g in state.groups:
        for p, slot in zip(g.params, g.layout.slots, strict=True):
            keys = names.get(id(p), [])
            present = [k for k in keys if k in state_dict]
            if not present:
                continue  # torch reports it missing (strict) or keeps the value
            value = state_dict[present[0]]
            taken.update(keys)
            for k in present:
                del state_dict[k]
            # A DTensor parameter takes its own piece of a full or DTensor value.
            local = local_piece(p, value) if isinstance(value, torch.Tensor) else None
            if local is None or tuple(local.shape) != slot.shape:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
                want = tuple(p.shape) if is_dtensor(p) else slot.shape
                error_msgs.append(
                    f"size mismatch for {present[0]}: copying a param with shape {shape} "
                    f"from checkpoint, the shape in current model is {want}."
                )
                continue
            copies.append((g, slot, local))
    # Before any master changes: a refused load leaves every rank as it was.
    _check_same_on_every_rank(state, len(taken))
    for g, slot, value in copies:
        # The overlap of this parameter's slot with this rank's shard range.
        lo, hi = g.shard_range
        start, end = max(slot.offset, lo), min(slot.end, hi)
        if start < end:
            piece = value.detach().reshape(-1)[start - slot.offset : end - slot.offset]
            g.master[start - lo : end - lo].copy_(piece)
    # Every group, on every rank: the publishes are collectives (stages 1/2), and
    # stage 3 drops what is gathered, which holds the old values.
    state.republish()
    return taken


def _check_same_on_every_rank(state: EngineState, keys: int) -> None:
    """Each rank loads only its own part: a rank given fewer keys would silently keep old
    values there (an FSDP-style dict on rank 0 only, say)."""
    counts = torch.tensor([keys, -keys], dtype=torch.int64, device=state.shard_group.device)
    state.shard_group.all_reduce(counts, op="max", label="load_state_dict key count").wait()
    most, fewest = int(counts[0]), -int(counts[1])
    if most != fewest:
        raise ValueError(
            f"load_state_dict: the ranks were given different state dicts ({fewest} to {most} "
            "parameter keys): every rank must pass the whole state dict (broadcast it from "
            "rank 0 first, or use zs.load_safetensors / zs.load_checkpoint)"
        )
