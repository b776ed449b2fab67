"""`issue_async`: split each gather and reduce-scatter into an async start and a wait.

[Note: start and wait]
`zeroshard::gather` and `zeroshard::reduce_scatter` wait for their collective inside the
op: simple to trace, but nothing overlaps it. This last pass rewrites them into torch's
functional collectives (`_c10d_functional.all_gather_into_tensor` /
`reduce_scatter_tensor`, then `wait_tensor`), which inductor and the eager runtime issue
asynchronously (on NCCL, on the communicator's own stream): the start stays where
`prefetch` put the gather, the wait goes just before the first use, so the compute in
between overlaps the collective. A reduce-scatter is waited on just before the next one
starts (one in flight: its full-size gradient input lives until the wait) or before its
first use. `zeroshard::account` keeps `EngineStats` counting.

[Note: in-place collectives]
A gather of its own is in place: the shard is cast straight into this rank's part of a
new full buffer (`empty`, then `copy_` into the part, as inductor's bucketing does: plain
aten, so inductor writes the cast into the part in one kernel), and
`all_gather_into_tensor_out` gathers into that buffer from that part, so NCCL does not
copy the rank's own part again (as the eager engine gathers: [Note: in-place gather] in
zeroshard.engine). A reduce-scatter whose full-size input nothing else reads is in place
too: its result is this rank's part of that input, so NCCL does not copy it out. What
this saves is the rank's own part: 1/world of the bytes, so all of them on one GPU (where
NCCL's collectives are plain device copies: docs/benchmarks.md, design-measurements) and
little on many. Fused runs of small gathers are left out of place (they are
copied apart anyway).

[Note: fp8 on the wire]
An fp8 gather's shard is cast with torchao's cast of the compute-dtype weight, each
weight's segment of the shard with its own scale (`Float8Wire.segments`: a few slices,
which inductor fuses into the one kernel writing the buffer's part), and travels as
uint8 (the same bytes; gloo has no fp8 type), viewed back as fp8 after the wait.
"""

from __future__ import annotations

import itertools

import torch
from torch import fx

from zeroshard.compile._graph import (
    Positions,
    gathers,
    is_float8_gather,
    is_reduce_scatter,
    is_view,
    nbytes,
    order,
    refresh_val,
)
from zeroshard.compile._ops import divisor_of, group_name, rank_of, replicate_of, wire_of
from zeroshard.compile._pipeline import PassContext

_c10d = torch.ops._c10d_functional
aten = torch.ops.aten
_ACCOUNT = torch.ops.zeroshard.account.default


def _call(
    graph: fx.Graph,
    target: object,
    args: tuple[object, ...],
    kwargs: dict[str, object] | None = None,
) -> fx.Node:
    node = graph.call_function(target, args, kwargs)  # type: ignore[arg-type]
    refresh_val(node)
    return node


def _first_user(nodes: list[fx.Node]) -> fx.Node:
    index = order(nodes[0].graph)
    users = [u for n in nodes for u in n.users]
    return min(users, key=index.__getitem__) if users else nodes[-1].next


def _runs(graph: fx.Graph, fuse_bytes: int) -> list[list[fx.Node]]:
    """Gathers grouped into runs issued as one collective: adjacent in the graph (where
    `prefetch` chained them), same process group, size and dtype, each <= `fuse_bytes`."""
    runs: list[list[fx.Node]] = []
    for gather in gathers(graph):
        last = runs[-1][-1] if runs else None
        if (
            last is not None
            and last.next is gather
            and last.args[2:4] == gather.args[2:4]
            and group_name(_key(last)) == group_name(_key(gather))
            and max(nbytes(last), nbytes(gather)) <= fuse_bytes
        ):
            runs[-1].append(gather)
        else:
            runs.append([gather])
    return runs


def _key(gather: fx.Node) -> int:
    key = gather.args[1]
    assert isinstance(key, int)
    return key


def _send(graph: fx.Graph, gather: fx.Node) -> fx.Node:
    """The shard cast to the gather's dtype (the cast happens before communication)."""
    shard, dtype = gather.args[0], gather.args[3]
    assert isinstance(shard, fx.Node) and isinstance(dtype, torch.dtype)
    if is_float8_gather(gather):
        return _float8_send(graph, gather, shard, dtype)
    if shard.meta.get("val") is not None and shard.meta["val"].dtype == dtype:
        return shard
    return _call(graph, torch.ops.prims.convert_element_type.default, (shard, dtype))


def _float8_send(graph: fx.Graph, gather: fx.Node, shard: fx.Node, dtype: torch.dtype) -> fx.Node:
    """The shard in fp8, each segment scaled by its weight's scale ([Note: fp8 on the
    wire]): `Float8Wire.cast_into`, as aten."""
    key, scales = gather.args[1], gather.args[4]
    assert isinstance(key, int) and isinstance(scales, fx.Node)
    wire = wire_of(key)
    convert = torch.ops.prims.convert_element_type.default
    limit = torch.finfo(dtype).max
    parts = []
    for start, end, slot in wire.segments:
        piece = _call(graph, aten.slice.Tensor, (shard, 0, start, end))
        wide = _call(
            graph, convert, (_call(graph, convert, (piece, wire.compute_dtype)), torch.float32)
        )
        scale = _call(graph, aten.select.int, (scales, 0, slot))
        scaled = _call(graph, aten.mul.Tensor, (wide, scale))
        # Saturated as torchao's cast, in the ops inductor lowers (it decomposes clamp).
        scaled = _call(graph, aten.clamp_min.default, (scaled, -limit))
        scaled = _call(graph, aten.clamp_max.default, (scaled, limit))
        parts.append(_call(graph, convert, (scaled, dtype)))
    return parts[0] if len(parts) == 1 else _call(graph, aten.cat.default, (parts,))


def _as_bytes(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """`node` viewed as uint8 when it is fp8 ([Note: fp8 on the wire])."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val.is_floating_point() and val.element_size() == 1:
        return _call(graph, aten.view.dtype, (node, torch.uint8))
    return node


def _gather_in_place(graph: fx.Graph, gather: fx.Node) -> fx.Node:
    """An all-gather into a buffer whose own part already holds the cast shard (see
    [Note: in-place collectives]); returns the collective's (async) result."""
    shard, key, world = gather.args[:3]
    assert isinstance(shard, fx.Node) and isinstance(key, int) and isinstance(world, int)
    cast = _send(graph, gather)
    size = cast.meta["val"].numel()
    full = graph.call_function(
        aten.empty.memory_format,
        ([world * size],),
        {"dtype": cast.meta["val"].dtype, "device": cast.meta["val"].device},
    )
    # No inputs to trace it from: its value is made from the cast shard's (fake) one.
    full.meta["val"] = cast.meta["val"].new_empty(world * size)
    own = _own_part(graph, full, rank_of(key), size)
    # The collective reads the part after this write: they are ordered by the graph.
    _call(graph, aten.copy_.default, (own, cast))
    return _call(
        graph,
        _c10d.all_gather_into_tensor_out.default,
        (_as_bytes(graph, own), world, group_name(key)),
        {"out": _as_bytes(graph, full)},
    )


def _own_part(graph: fx.Graph, full: fx.Node, rank: int, size: int) -> fx.Node:
    """This rank's `size` elements of the flat buffer `full`."""
    return _call(graph, aten.slice.Tensor, (full, 0, rank * size, (rank + 1) * size))


def _reduce_scatter(graph: fx.Graph, full: fx.Node, key: int, world: int) -> fx.Node:
    """A sum reduce-scatter of `full`, into this rank's part of it when nothing else reads
    `full` (see [Note: in-place collectives]); returns the collective's (async) result."""
    name = group_name(key)
    if full.op != "call_function" or is_view(full) or len(full.users) != 1:
        return _call(graph, _c10d.reduce_scatter_tensor.default, (full, "sum", world, name))
    own = _own_part(graph, full, rank_of(key), full.meta["val"].numel() // world)
    return _call(
        graph, _c10d.reduce_scatter_tensor_out.default, (full, "sum", world, name), {"out": own}
    )


def issue_async(graph: fx.Graph, context: PassContext) -> None:
    """Rewrite gathers and reduce-scatters into async starts and waits (see [Note: start
    and wait]); adjacent small gathers become one collective (`context.fuse_bytes`)."""
    for run in _runs(graph, context.fuse_bytes):
        world = run[0].args[2]
        assert isinstance(world, int)
        first = _first_user(run)
        group = group_name(_key(run[0]))
        with graph.inserting_before(run[0]):
            if len(run) == 1:
                start = _gather_in_place(graph, run[0])
            else:
                sends = [_send(graph, g) for g in run]
                send = _as_bytes(graph, _call(graph, aten.cat.default, (sends,)))
                start = _call(graph, _c10d.all_gather_into_tensor.default, (send, world, group))
        with graph.inserting_before(first):
            done = _call(graph, _c10d.wait_tensor.default, (start,))
            dtype = run[0].args[3]
            assert isinstance(dtype, torch.dtype)
            if done.meta["val"].dtype != dtype:  # fp8, sent as uint8
                done = _call(graph, aten.view.dtype, (done, dtype))
            outs = [done]
            if len(run) > 1:
                # Rank-major [rank][gather 0 | gather 1 | ...]: each gather's full buffer
                # is its column block, copied out contiguous (small: runs are of small
                # gathers only); the fused buffer dies after the copies.
                sizes = [s.meta["val"].numel() for s in sends]
                grid = _call(graph, aten.view.default, (done, [world, sum(sizes)]))
                outs, offset = [], 0
                for size in sizes:
                    block = _call(graph, aten.slice.Tensor, (grid, 1, offset, offset + size))
                    flat = _call(graph, aten.clone.default, (block,))
                    outs.append(_call(graph, aten.view.default, (flat, [world * size])))
                    offset += size
            for gather, out in zip(run, outs, strict=True):
                graph.call_function(_ACCOUNT, (out, _key(gather), False))
        for gather, out in zip(run, outs, strict=True):
            gather.replace_all_uses_with(out)
            graph.erase_node(gather)
    finished: list[tuple[fx.Node, list[fx.Node]]] = []
    for rs in [n for n in graph.nodes if is_reduce_scatter(n)]:
        full, key, world = rs.args
        assert isinstance(full, fx.Node) and isinstance(key, int) and isinstance(world, int)
        first = _first_user([rs])
        with graph.inserting_before(rs):
            # Sum, then divide the shard: gloo has no average.
            start = _reduce_scatter(graph, full, key, world)
        with graph.inserting_before(first):
            done = _call(graph, _c10d.wait_tensor.default, (start,))
            counted = graph.call_function(_ACCOUNT, (full, key, True))
            mean = _call(graph, torch.ops.aten.div.Scalar, (done, divisor_of(key)))
            tail = [done, counted, mean]
            replicate = replicate_of(key)
            if replicate is not None:
                # Hybrid sharding: then averaged over the ranks holding the same shard.
                name, size = replicate
                summed = _call(graph, _c10d.all_reduce.default, (mean, "sum", name))
                summed_done = _call(graph, _c10d.wait_tensor.default, (summed,))
                mean = _call(graph, torch.ops.aten.div.Scalar, (summed_done, size))
                tail += [summed, summed_done, mean]
        rs.replace_all_uses_with(mean)
        graph.erase_node(rs)
        finished.append((start, tail))
    # One reduce-scatter in flight: each is finished before the next starts, so its
    # full-size gradient input is freed there (see [Note: start and wait]).
    place = Positions(graph)
    for (_, tail), (start, _) in itertools.pairwise(finished):
        if place[tail[0]] > place[start]:
            for node in tail:
                place.move_before(node, start)
