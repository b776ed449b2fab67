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
"""

from __future__ import annotations

import itertools

import torch
from torch import fx

from zeroshard.compile._graph import gathers, is_reduce_scatter, nbytes, order, refresh_val
from zeroshard.compile._ops import group_name, replicate_of
from zeroshard.compile._pipeline import PassContext

_c10d = torch.ops._c10d_functional
aten = torch.ops.aten
_ACCOUNT = torch.ops.zeroshard.account.default


def _call(graph: fx.Graph, target: object, args: tuple[object, ...]) -> fx.Node:
    node = graph.call_function(target, args)  # type: ignore[arg-type]
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
    assert isinstance(shard, fx.Node)
    if shard.meta.get("val") is not None and shard.meta["val"].dtype == dtype:
        return shard
    return _call(graph, torch.ops.prims.convert_element_type.default, (shard, dtype))


def issue_async(graph: fx.Graph, context: PassContext) -> None:
    """Rewrite gathers and reduce-scatters into async starts and waits (see [Note: start
    and wait]); adjacent small gathers become one collective (`context.fuse_bytes`)."""
    for run in _runs(graph, context.fuse_bytes):
        world = run[0].args[2]
        assert isinstance(world, int)
        first = _first_user(run)
        with graph.inserting_before(run[0]):
            sends = [_send(graph, g) for g in run]
            send = sends[0] if len(run) == 1 else _call(graph, aten.cat.default, (sends,))
            start = _call(
                graph, _c10d.all_gather_into_tensor.default, (send, world, group_name(_key(run[0])))
            )
        with graph.inserting_before(first):
            done = _call(graph, _c10d.wait_tensor.default, (start,))
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
            start = _call(
                graph, _c10d.reduce_scatter_tensor.default, (full, "sum", world, group_name(key))
            )
        with graph.inserting_before(first):
            done = _call(graph, _c10d.wait_tensor.default, (start,))
            counted = graph.call_function(_ACCOUNT, (full, key, True))
            mean = _call(graph, torch.ops.aten.div.Scalar, (done, world))
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
    for (_, tail), (start, _) in itertools.pairwise(finished):
        if order(graph)[tail[0]] > order(graph)[start]:
            for node in tail:
                start.prepend(node)
