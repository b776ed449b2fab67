"""The full masters (in their dtype: fp32 unless `precision.master_dtype`), one all-gather
per flat group, for `full_state_dict` and `gathered_parameters`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zeroshard.comm import Handle, arrive
from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._names import canonical_name
from zeroshard.engine.runtime._state import EngineModel, engine_module, engine_state

# What `arrive` tells a rank that called a gathering function alone.
COLLECTIVE = (
    "Call it on every rank (each gets the whole dict); to keep the values on rank 0 only, "
    "call model.state_dict() on every rank inside `with zs.state_dict_on_rank0(model):`"
)


def gather_masters(groups: Sequence[FlatParamGroup], label: str) -> list[torch.Tensor]:
    """Every rank's master shard of each group, all-gathered into one full buffer
    per group on the group's device (collective; the groups in the same order everywhere)."""
    handles: list[Handle] = []
    fulls: list[torch.Tensor] = []
    for g in groups:
        device = g.process_group.device
        full = torch.empty(g.layout.padded_numel, dtype=g.master.dtype, device=device)
        # Offloaded masters are on the host: they travel from the group's device.
        send = g.master.detach().to(device)
        handles.append(
            g.process_group.all_gather_into(full, send, label=f"{label} of group {g.index}")
        )
        fulls.append(full)
    for h in handles:
        h.wait()
    return fulls


@torch.no_grad()
def full_state_dict(model: EngineModel) -> dict[str, torch.Tensor]:
    """The full state dict on CPU, keyed like `model.state_dict()` before wrapping: the
    masters in their dtype (fp32 unless `precision.master_dtype`).

    Collective: call it on every rank; every rank gets the whole dict (parameters split by
    tensor parallelism whole, their pieces joined). Tied parameters
    appear under each of their names, as in `state_dict()`; buffers keep their dtype. Names
    under a block compiled before `initialize` lose torch.compile's `_orig_mod.` (_names.py).
    """
    model = engine_module(model)
    state = engine_state(model)
    arrive(state.shard_group, "zs.full_state_dict", COLLECTIVE)
    # The masters of every step() so far, a delayed one (delay_param_update) included.
    state.settle()
    full: dict[int, torch.Tensor] = {}
    tp = state.tensor_parallel
    for g in state.groups:
        # One group at a time: at most one full fp32 group lives on the device.
        (out,) = gather_masters([g], "full_state_dict")
        if tp is not None and tp.is_split_group(g.key.process_group):
            # Pieces of parameters split over tp: joined into their full tensors.
            for p, value in zip(g.params, tp.full_values(out, g.layout, g.params), strict=True):
                full[id(p)] = value.cpu()
            continue
        for p, slot in zip(g.params, g.layout.slots, strict=True):
            full[id(p)] = out[slot.offset : slot.end].view(slot.shape).cpu().clone()
    result: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        gathered = full.get(id(value))
        result[canonical_name(name)] = (
            gathered if gathered is not None else value.detach().cpu().clone()
        )
    return result
