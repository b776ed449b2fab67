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
first use. `zeroshard::account` keeps `GatherStats` counting.
"""

from __future__ import annotations

import itertools

import torch
from torch import fx

from zeroshard.compile._graph import gathers, is_reduce_scatter, order, refresh_val
from zeroshard.compile._ops import group_name
from zeroshard.compile._pipeline import PassContext

_c10d = torch.ops._c10d_functional
_ACCOUNT = torch.ops.zeroshard.account.default


def _call(graph: fx.Graph, target: object, args: tuple[object, ...]) -> fx.Node:
    node = graph.call_function(target, args)  # type: ignore[arg-type]
    refresh_val(node)
    return node


def _first_user(node: fx.Node) -> fx.Node:
    index = order(node.graph)
    return min(node.users, key=index.__getitem__)


def issue_async(graph: fx.Graph, context: PassContext) -> None:
    """Rewrite gathers and reduce-scatters into async starts and waits (see [Note: start
    and wait])."""
    for gather in gathers(graph):
        shard, key, world, dtype, _ = gather.args
        assert isinstance(shard, fx.Node) and isinstance(key, int) and isinstance(world, int)
        first = _first_user(gather)
        with graph.inserting_before(gather):
            send = shard
            if shard.meta.get("val") is None or shard.meta["val"].dtype != dtype:
                send = _call(graph, torch.ops.prims.convert_element_type.default, (shard, dtype))
            start = _call(
                graph, _c10d.all_gather_into_tensor.default, (send, world, group_name(key))
            )
        with graph.inserting_before(first):
            done = _call(graph, _c10d.wait_tensor.default, (start,))
            graph.call_function(_ACCOUNT, (done, key, False))
        gather.replace_all_uses_with(done)
        graph.erase_node(gather)
    finished: list[tuple[fx.Node, list[fx.Node]]] = []
    for rs in [n for n in graph.nodes if is_reduce_scatter(n)]:
        full, key, world = rs.args
        assert isinstance(full, fx.Node) and isinstance(key, int) and isinstance(world, int)
        first = _first_user(rs)
        with graph.inserting_before(rs):
            # Sum, then divide the shard: gloo has no average.
            start = _call(
                graph, _c10d.reduce_scatter_tensor.default, (full, "sum", world, group_name(key))
            )
        with graph.inserting_before(first):
            done = _call(graph, _c10d.wait_tensor.default, (start,))
            counted = graph.call_function(_ACCOUNT, (full, key, True))
            mean = _call(graph, torch.ops.aten.div.Scalar, (done, world))
        rs.replace_all_uses_with(mean)
        graph.erase_node(rs)
        finished.append((start, [done, counted, mean]))
    # One reduce-scatter in flight: each is finished before the next starts, so its
    # full-size gradient input is freed there (see [Note: start and wait]).
    for (_, tail), (start, _) in itertools.pairwise(finished):
        if order(graph)[tail[0]] > order(graph)[start]:
            for node in tail:
                start.prepend(node)
