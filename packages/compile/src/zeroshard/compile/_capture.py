"""The functional capture: a stage-3 model's forward as a function of its flat shards.

[Note: functional capture]
Eager stage 3 gathers in module hooks, which Dynamo cannot keep in one graph. Here the
forward is rewritten as `forward(shards, args, kwargs)`: every flat group's master
shard is gathered with `zeroshard::gather` (then cast to the compute dtype, which
`fuse_downcast` folds into the gather), viewed into the group's parameters, and the
module runs with those views in place of its parameters. Dynamo sees one graph with no
break at unit boundaries; AOTAutograd derives backward from the gather's autograd
formula (a reduce-scatter into the shard's gradient). The shards are the real master
parameters, so their gradients land where `ZeroOptimizer.step()` reads them (see
`route_grads`).

The views go straight into each holder's `_parameters` (every module and attribute that
holds the parameter: tied weights have several) and the parameters go back in `finally`.
`torch.func.functional_call` would do the same through its generic reparametrization,
which Dynamo traces too, and takes longer to trace (docs/benchmarks.md,
design-measurements).

A group of torchao's fp8 weights (`zs.float8_wire`) is gathered in fp8 instead, its
weights going in as the `Float8TrainingTensor`s their `Float8Linear`s compute with
(`_float8.GatheredFloat8`); its scales are inputs of the graph, rewritten in place by
the engine after every step.
"""

from __future__ import annotations

import itertools
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from zeroshard.compile._float8 import GatheredFloat8
from zeroshard.compile._host import GatheredToHost
from zeroshard.compile._ops import register_target
from zeroshard.engine import EngineState, EngineStats, HomeKind, float8_wire

_forwards = itertools.count()

Forward = Callable[
    [
        list[torch.Tensor],
        list[torch.Tensor | None],
        list[torch.Tensor | None],
        tuple[Any, ...],
        dict[str, Any],
    ],
    Any,
]


@dataclass(frozen=True)
class FlatSpec:
    """How one flat group is gathered and viewed into its parameters inside the graph."""

    key: int
    world: int
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    # The gathered buffer is split into these consecutive pieces (parameters, alignment
    # gaps, padding): one split, whose backward is one concatenation of the gradients.
    pieces: tuple[int, ...]
    # (index of its piece, shape) per parameter, in the group's order.
    slots: tuple[tuple[int, tuple[int, ...]], ...]
    # A group of torchao's fp8 weights: gathered in fp8 (`GatheredFloat8`).
    float8: bool
    # Homed on the host: gathered from its compute shard, its gradient into a sink
    # ([Note: host groups in the graph] in _host.py).
    host: bool


def flat_specs(state: EngineState, stats: EngineStats) -> list[FlatSpec]:
    """One spec per flat group of `state`, each registered under a fresh op key."""
    specs = []
    for g in state.groups:
        # Under hybrid sharding (a 3-D mesh's too) the groups' gradients are then averaged
        # over `replicate`, as the eager reducer does; not a group of its own (experts).
        replicate = state.replicate if state.replicated(g) else None
        wire = float8_wire(g)
        label = f"flat group {g.index}"
        key = register_target(g.process_group, stats, label, replicate, wire, g.grad_divisor)
        pieces, piece_of_slot = g.layout.split_sizes()
        slots = tuple(
            (piece, tuple(s.shape)) for piece, s in zip(piece_of_slot, g.layout.slots, strict=True)
        )
        specs.append(
            FlatSpec(
                key,
                g.process_group.size,
                state.config.precision.compute_dtype,
                state.config.precision.grad_reduce_dtype,
                pieces,
                slots,
                wire is not None,
                g.home.kind is HomeKind.HOST,
            )
        )
    return specs


def graph_shards(state: EngineState) -> list[torch.Tensor]:
    """Per flat group of `state`, what its gather reads in the graph: the master (its
    gradient accumulates there), or a host group's compute shard on the device, ready
    for the current stream (call it before each run: an upload may be in flight)."""
    return [
        g.home.compute_shard() if g.home.kind is HomeKind.HOST else g.master for g in state.groups
    ]


def graph_scales(state: EngineState) -> list[torch.Tensor | None]:
    """Per flat group of `state`, the scales its fp8 gather reads (None: not fp8)."""
    wires = [float8_wire(g) for g in state.groups]
    return [None if w is None else w.scales for w in wires]


def gathered_forward(model: nn.Module, state: EngineState, specs: Sequence[FlatSpec]) -> Forward:
    """`forward(shards, scales, sinks, args, kwargs)`: gather every group of `state`
    (`specs` are its groups' specs; `shards` what each gather reads, `scales` an fp8
    group's scales, `sinks` a host group's gradient sink) and run `model` on the views."""
    holders = _holders(model)
    # (holders, piece, shape, the DTensor it is a piece of or None) per parameter of each
    # spec, in the specs' order.
    places = [
        [
            (holders[id(p)], piece, shape, p if isinstance(p, DTensor) else None)
            for p, (piece, shape) in zip(g.params, spec.slots, strict=True)
        ]
        for g, spec in zip(state.groups, specs, strict=True)
    ]

    def forward(
        shards: list[torch.Tensor],
        scales: list[torch.Tensor | None],
        sinks: list[torch.Tensor | None],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        swapped: list[tuple[dict[str, Any], str, Any]] = []
        try:
            for spec, shard, scale, sink, spec_places in zip(
                specs, shards, scales, sinks, places, strict=True
            ):
                views: tuple[torch.Tensor, ...]
                if spec.float8:
                    views = GatheredFloat8.apply(  # type: ignore[no-untyped-call]
                        shard,
                        scale,
                        sink,
                        spec.key,
                        spec.world,
                        spec.reduce_dtype,
                        spec.pieces,
                        spec.slots,
                    )
                    # A DTensor weight's fp8 piece as a DTensor of its placement, as in eager.
                    views = tuple(
                        _as_param(v, place[3]) for v, place in zip(views, spec_places, strict=True)
                    )
                elif sink is not None:
                    gather_to_host: Any = GatheredToHost.apply
                    split = gather_to_host(shard, sink, spec.key, spec.world).split(spec.pieces)
                    views = tuple(
                        _as_param(split[piece].view(shape), dt)
                        for _, piece, shape, dt in spec_places
                    )
                else:
                    # Gathered in the master's dtype, then cast: the fused-downcast
                    # pass moves the cast before the collective (nothing to move when
                    # the masters are in the compute dtype).
                    full = torch.ops.zeroshard.gather(
                        shard, spec.key, spec.world, shard.dtype, spec.reduce_dtype
                    )
                    if spec.compute_dtype != shard.dtype:
                        full = full.to(spec.compute_dtype)
                    split = full.split(spec.pieces)
                    views = tuple(
                        _as_param(split[piece].view(shape), dt)
                        for _, piece, shape, dt in spec_places
                    )
                for (owners, _, _, _), view in zip(spec_places, views, strict=True):
                    for params, attr in owners:
                        swapped.append((params, attr, params[attr]))
                        params[attr] = view
            return model(*args, **kwargs)
        finally:
            for params, attr, original in reversed(swapped):
                params[attr] = original

    # Dynamo caches per code object: one of its own for each model, so that a second
    # model is not a recompilation of the first, which would turn the differing op keys
    # into symbolic ints (and count against the first's recompile limit).
    code = forward.__code__.replace(co_name=f"zeroshard_forward_{next(_forwards)}")
    return types.FunctionType(
        code, forward.__globals__, code.co_name, forward.__defaults__, forward.__closure__
    )


def _as_param(view: torch.Tensor, dtensor: DTensor | None) -> torch.Tensor:
    """`view` (a parameter's values on this rank) as the module computes with it: for a
    piece of a DTensor parameter (tensor parallelism) a DTensor of the parameter's mesh,
    placement and shape, made in the graph, whose backward brings its gradient to that
    placement (a `Partial` one all-reduced over tp) before the gather's reduce-scatter."""
    if dtensor is None:
        return view
    return DTensor.from_local(
        view,
        dtensor.device_mesh,
        dtensor.placements,
        run_check=False,
        shape=dtensor.shape,
        stride=dtensor.stride(),
    )


def _holders(model: nn.Module) -> dict[int, list[tuple[dict[str, Any], str]]]:
    """Each parameter (by id) -> the `_parameters` dict and attribute of every module
    holding it (a tied parameter has several)."""
    holders: dict[int, list[tuple[dict[str, Any], str]]] = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((module._parameters, attr))
    return holders


def route_grads(state: EngineState) -> list[RemovableHandle]:
    """Make each device master's accumulated gradient the engine's gradient shard.

    Autograd accumulates into `master.grad` (set, or added to when already set); the
    engine's optimizer reads `grad_shard`, which must be that same tensor. (A group homed
    on the host takes its gradient through a sink: `_host.route_host_grads`.)
    """
    handles = []
    for g in state.groups:
        if g.trainable and g.home.kind is HomeKind.DEVICE:
            register = g.master.register_post_accumulate_grad_hook  # untyped in torch
            handles.append(register(_grad_shard_hook(weakref.ref(g))))  # type: ignore[no-untyped-call]
    return handles


def _grad_shard_hook(group: weakref.ref[Any]) -> Callable[[torch.Tensor], None]:
    # Weakly: torch keeps a post-accumulate hook in the tensor's C++ autograd data, which
    # the cycle collector does not see, so a hook reaching back to its master (through the
    # group) would keep the master, and with it the whole engine, alive forever.
    def hook(master: torch.Tensor) -> None:
        owner = group()
        if owner is not None:
            owner.home.take_master_grad()

    return hook
