"""`Float8Wire`: stage 3 gathers torchao's fp8 weights in fp8 (the wire of their flat
groups: [Note: home and wire] in _home.py).

[Note: the fp8 gather]
A flat group of fp8 weights (`Float8Linear` weights whose config sets
`enable_fsdp_float8_all_gather`: `plan_flat_groups` gives them groups of their own)
keeps its gathered buffer in fp8. A gather casts this rank's shard (the master, or the
compute copy an offloaded group's home keeps on the device) to fp8, each weight's part
with that weight's scale, straight into this rank's part of the buffer and all-gathers
in place ([Note: in-place gather] in _collectives.py): one byte per element travels,
and the cast is the downcast a compute-dtype gather makes anyway, so nothing is added.
Where the group's process group has one rank nothing travels, so nothing would be saved:
`plan_flat_groups` then leaves those weights in the compute-dtype groups and their
`Float8Linear`s cast them (the same bits, below).

A weight's scale is torchao's tensorwise one, `finfo(fp8).max / amax`, from the amax of
the whole weight: each rank takes the amax of each weight's piece of its shard, and one
MAX all-reduce of all those amaxes over the process group gives every rank every
weight's amax (one collective for all fp8 weights, not one per weight). Under tensor
parallelism a group's shards are of the tp pieces ([Note: DTensor parameters] in
_tensor_parallel.py): a second MAX all-reduce, over tp, makes it the amax of the whole
DTensor weight, which is what torchao's cast of a DTensor takes (its max over a DTensor
is one over the mesh). The scales are
taken after every step and after every change of the masters (a load), as torchao's
`precompute_float8_dynamic_scale_for_fsdp` does for FSDP2, so forward and backward of a
step cast alike and a gather needs no collective of its own.

The cast rounds to the compute dtype first (fp32 -> bf16 -> fp8) and the amax is the
compute-dtype weight's: exactly what `Float8Linear` does when it casts a compute-dtype
weight itself, so the fp8 gather is bit for bit the compute-dtype gather followed by
torchao's own cast (tests/engine/test_float8.py checks it).

While its unit is gathered, an fp8 weight's parameter holds a stand-in of its shape
(autograd accumulates its gradient as ever, and the reducer takes it from there); the
`Float8Linear` reads its weight as torchao's `Float8TrainingTensor` over its slot of
the buffer with its scale, which a forward pre-hook puts into the module's
`_parameters` for its own forward only and whose gradient goes to the parameter. A
DTensor weight's is a DTensor of its placement over that tensor: what FSDP2 hands
torchao's `Float8ColwiseParallel` / `Float8RowwiseParallel` after its fp8 gather.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zeroshard.comm import Group
from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._float8 import Float8Weight, one_float8_dtype
from zeroshard.engine.runtime._stats import EngineStats
from zeroshard.engine.runtime._tensor_parallel import data_of, like_param
from zeroshard.engine.runtime._wire import Wire, WireKind, WireStore
from zeroshard.partition import FlatLayout


@dataclass(frozen=True, eq=False)
class Float8Wire(Wire):
    """How one flat group of fp8 weights travels, for the eager gathers and for
    `zeroshard.compile`'s: the fp8 `dtype`; one fp32 scale per slot (`scales`, rewritten
    in place by its `store` after every step); this rank's shard cut into `segments`
    (start, end, slot), each cast with its slot's scale (alignment gaps and padding go
    with a neighbour: they are zeros); and per slot the weight that makes its data the
    `Float8Linear`'s."""

    kind = WireKind.FLOAT8
    dtype: torch.dtype
    compute_dtype: torch.dtype
    scales: torch.Tensor
    segments: tuple[tuple[int, int, int], ...]
    weights: tuple[Float8Weight, ...]
    store: WireStore

    def encode_into(self, out: torch.Tensor, shard: torch.Tensor) -> None:
        """This rank's `shard` cast to fp8 with the current scales into `out`."""
        self.cast_into(out, shard, self.scales)

    def cast_into(self, out: torch.Tensor, shard: torch.Tensor, scales: torch.Tensor) -> None:
        """Write `shard` (this rank's, in any float dtype) cast to fp8 into `out`:
        torchao's cast of the compute-dtype weight (upcast, scaled, saturated), bit for
        bit."""
        limit = torch.finfo(self.dtype).max
        for start, end, slot in self.segments:
            # A copy of its own (at fp32 compute too), scaled and saturated in place.
            wide = shard[start:end].to(self.compute_dtype).to(torch.float32, copy=True)
            out[start:end].copy_(wide.mul_(scales[slot]).clamp_(-limit, limit))

    def weight(self, slot: int, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Slot `slot`'s fp8 `data` (shaped like the weight) as the tensor its
        `Float8Linear` computes with: torchao's `Float8TrainingTensor`."""
        return _float8_tensor(data, scale, self.compute_dtype, self.weights[slot].mm_config)


def _float8_tensor(
    data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, mm_config: Any
) -> torch.Tensor:
    """fp8 `data` with its `scale` as torchao's weight tensor, computing in `dtype`."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

    out: torch.Tensor = Float8TrainingTensor(data, scale, dtype, mm_config, GemmInputRole.WEIGHT)
    return out


@torch._dynamo.allow_in_graph
class _Float8Weight(torch.autograd.Function):
    """The `Float8TrainingTensor` a `Float8Linear` computes with, its gradient going to
    the weight's parameter (a stand-in of its shape while gathered). Dynamo keeps it
    whole (as torchao's own casts), so blocks compiled one by one take it too."""

    @staticmethod
    def forward(
        ctx: Any,
        param: torch.Tensor,
        data: torch.Tensor,
        scale: torch.Tensor,
        mm_config: Any,
    ) -> torch.Tensor:
        # A DTensor weight (tensor parallelism) computes with a DTensor of its placement
        # over the fp8 piece, as FSDP2 hands torchao's TP styles after its fp8 gather.
        return like_param(param, _float8_tensor(data, scale, param.dtype, mm_config))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return grad, None, None, None


def segments(layout: FlatLayout, lo: int, hi: int) -> tuple[tuple[int, int, int], ...]:
    """Shard [lo, hi) of `layout` cut at slot boundaries: (start, end, slot) in shard
    coordinates. Slot k owns [its offset, the next slot's); what lies before the first
    slot goes with it."""
    slots = layout.slots
    out = []
    for k, slot in enumerate(slots):
        start = 0 if k == 0 else slot.offset
        end = slots[k + 1].offset if k + 1 < len(slots) else layout.padded_numel
        a, b = max(lo, start), min(hi, end)
        if a < b:
            out.append((a - lo, b - lo, k))
    return tuple(out)


class Float8Wires:
    """Builds the fp8 weights' wires and takes their scales (see [Note: the fp8 gather]).

    `weights` are the model's fp8 weights by id(parameter) (one fp8 dtype for all, as
    torchao's own scale precomputation takes); the scales' all-reduces are counted in
    `stats`. Under tensor parallelism `tp` is its group: a group's shards are then of
    the local pieces, and the amax of a whole weight is a max over tp too.
    """

    def __init__(
        self,
        weights: Mapping[int, Float8Weight],
        compute_dtype: torch.dtype,
        stats: EngineStats,
        tp: Group | None = None,
    ) -> None:
        self._dtype = one_float8_dtype(weights)
        self._tp = tp
        self.compute_dtype = compute_dtype
        self._weights = dict(weights)
        self._stats = stats

    @property
    def dtype(self) -> torch.dtype:
        """The fp8 dtype: the gathered buffers hold fp8."""
        return self._dtype

    def build(
        self,
        params: Sequence[nn.Parameter],
        layout: FlatLayout,
        shard_range: tuple[int, int],
        slots: Sequence[torch.Tensor],
    ) -> Float8Wire:
        """The wire of a stage-3 group of fp8 weights, its scales 1 until the first
        `refresh`; hooks on their `Float8Linear`s read the slots of its gathered buffer.
        The runtime's gather hooks run before these (they are registered in front)."""
        if not slots:
            raise ValueError("the fp8 gather is a stage-3 gather: its group needs a buffer")
        lo, hi = shard_range
        weights = tuple(self._weights[id(p)] for p in params)
        scales = torch.ones(len(params), dtype=torch.float32, device=slots[0].device)
        wire = Float8Wire(
            self._dtype,
            self.compute_dtype,
            scales,
            segments(layout, lo, hi),
            weights,
            self,
        )
        for slot, (param, w) in enumerate(zip(params, weights, strict=True)):
            _install_hooks(w.module, param, slots[slot], slot, wire)
        return wire

    @torch.no_grad()
    def refresh(self, groups: Sequence[FlatParamGroup]) -> None:
        """Every fp8 weight's scale from the amax of the whole weight, after the masters
        changed: one MAX all-reduce per process group of all the groups' local amaxes,
        then one over tp (collective, in `groups`' order)."""
        by_group: dict[int, tuple[Group, list[FlatParamGroup]]] = {}
        for g in groups:
            if isinstance(g.wire, Float8Wire):
                by_group.setdefault(id(g.process_group), (g.process_group, []))[1].append(g)
        for process_group, same in by_group.values():
            amax = torch.cat([_local_amax(g) for g in same])
            process_group.all_reduce(amax, op="max", label="amax of the fp8 weights").wait()
            self._stats.scale_reductions += 1
            if self._tp is not None:
                # Each tp rank holds other pieces of a split weight (a replicated one's
                # are the same there, so the max leaves it as it is).
                self._tp.all_reduce(amax, op="max", label="amax of the fp8 weights over tp").wait()
                self._stats.scale_reductions += 1
            at = 0
            for g in same:
                wire = g.wire
                assert isinstance(wire, Float8Wire)
                n = len(g.params)
                wire.scales.copy_(_scales(amax[at : at + n], wire))
                at += n


def _local_amax(g: FlatParamGroup) -> torch.Tensor:
    """max |w| over each slot's piece of this rank's shard (0 where it holds none), read
    where the gathers read it (the master, or a compute-dtype copy of it: the amax of
    the rounded weight is the rounded amax, and `_scales` rounds it anyway)."""
    lo, hi = g.shard_range
    master = g.home.compute_shard()
    zero = master.new_zeros(())
    pieces = {}
    for k, slot in enumerate(g.layout.slots):
        a, b = max(lo, slot.offset), min(hi, slot.end)
        if a < b:
            pieces[k] = master[a - lo : b - lo]
    norms = {}
    if pieces:
        found = torch._foreach_norm(list(pieces.values()), ord=float("inf"))
        norms = dict(zip(pieces, found, strict=True))
    return torch.stack([norms.get(k, zero) for k in range(len(g.params))]).float()


def _scales(amax: torch.Tensor, wire: Float8Wire) -> torch.Tensor:
    """torchao's scales for the weights of `wire` from their fp32 amaxes: the amax of the
    compute-dtype weight (rounding is monotonic, so that is the fp32 amax rounded)."""
    from torchao.float8.float8_utils import amax_to_scale

    rounded = amax.to(wire.compute_dtype)
    out = amax_to_scale(rounded, wire.dtype)
    pow2 = [k for k, w in enumerate(wire.weights) if w.round_scales_to_power_of_2]
    if pow2:
        index = torch.tensor(pow2, device=amax.device)
        out[index] = amax_to_scale(rounded[index], wire.dtype, round_scales_to_power_of_2=True)
    result: torch.Tensor = out
    return result


def _install_hooks(
    module: nn.Module, param: nn.Parameter, view: torch.Tensor, slot: int, wire: Float8Wire
) -> None:
    """While `module` (a Float8Linear) runs gathered, its weight `param` is the fp8 slot
    `view` of the gathered buffer."""
    mm_config = wire.weights[slot].mm_config
    # The slot's fp8 data, through a tensor of its own: it shares the buffer's memory (and
    # sees every gather, the storage being resized, never replaced) but not its version
    # counter, so a graph that saved it for backward (a block compiled one by one) is not
    # refused for the re-gather that wrote the buffer in between, as a parameter's view is
    # not ([Note: released storage] in _flat_group.py).
    data = torch.empty(0, dtype=wire.dtype, device=view.device)
    data.data = view
    installed: list[torch.Tensor] = []

    def pre_forward(module: nn.Module, args: Any) -> None:
        # Only over the stand-in (all strides 0) of a gathered group: not where someone
        # else put the weight in (zeroshard.compile's graph), nor where the parameter
        # holds values Float8Linear casts itself (gathered_parameters' fp32 weights).
        if module._parameters.get("weight") is not param or any(data_of(param).stride()):
            return
        weight = _Float8Weight.apply(param, data, wire.scales[slot], mm_config)  # type: ignore[no-untyped-call]
        installed.append(weight)
        module._parameters["weight"] = weight

    def post_forward(module: nn.Module, args: Any, output: Any) -> None:
        if installed and module._parameters.get("weight") is installed[-1]:
            module._parameters["weight"] = param
        installed.clear()

    module.register_forward_pre_hook(pre_forward)
    module.register_forward_hook(post_forward, always_call=True)


def float8_wire(g: FlatParamGroup) -> Float8Wire | None:
    """How flat group `g` travels when it gathers in fp8 (torchao's fp8 weights at stage
    3: [Note: the fp8 gather]); None when it gathers in the compute dtype."""
    return g.wire if isinstance(g.wire, Float8Wire) else None
