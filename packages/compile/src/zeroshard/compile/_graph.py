"""What the passes need to read off an FX graph: gathers, their aliases, casts and sizes.

Works on both levels a pass sees: Dynamo's torch-level graph (`call_method` views and
`.to`, `operator.getitem` slices) and AOTAutograd's aten-level graphs.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable

import torch
from torch import fx

# Imported for its side effect: it registers the zeroshard:: ops read below.
from zeroshard.compile import _ops  # noqa: F401

_aten = torch.ops.aten
_GATHER = torch.ops.zeroshard.gather
_GATHER_FP8 = torch.ops.zeroshard.gather_fp8
_RELEASE = torch.ops.zeroshard.release
_REDUCE = torch.ops.zeroshard.reduce_scatter

# Ops whose output shares the input's memory: a use of them is a use of the gathered buffer.
_VIEW_TARGETS: frozenset[object] = frozenset(
    {
        operator.getitem,
        torch.split,
        _aten.slice.Tensor,
        _aten.split.Tensor,
        _aten.split_with_sizes.default,
        _aten.view.default,
        _aten.reshape.default,
        _aten._unsafe_view.default,
        _aten.as_strided.default,
        _aten.alias.default,
        _aten.t.default,
        _aten.permute.default,
        _aten.transpose.int,
        _aten.expand.default,
        _aten.unsqueeze.default,
        _aten.squeeze.dim,
    }
)
_VIEW_METHODS = frozenset(
    {"split", "view", "reshape", "t", "permute", "transpose", "expand", "unsqueeze"}
)


def is_gather(node: fx.Node) -> bool:
    """Whether `node` calls `zeroshard::gather` or `zeroshard::gather_fp8` (both take the
    shard, the op key, the world and the gathered dtype first)."""
    return node.op == "call_function" and node.target in (
        _GATHER,
        _GATHER.default,
        _GATHER_FP8,
        _GATHER_FP8.default,
    )


def is_float8_gather(node: fx.Node) -> bool:
    """Whether `node` calls `zeroshard::gather_fp8` (torchao's fp8 weights, in fp8)."""
    return node.op == "call_function" and node.target in (_GATHER_FP8, _GATHER_FP8.default)


def is_reduce_scatter(node: fx.Node) -> bool:
    """Whether `node` calls `zeroshard::reduce_scatter`."""
    return node.op == "call_function" and node.target in (_REDUCE, _REDUCE.default)


def is_release(node: fx.Node) -> bool:
    """Whether `node` calls `zeroshard::release`."""
    return node.op == "call_function" and node.target in (_RELEASE, _RELEASE.default)


def gathers(graph: fx.Graph) -> list[fx.Node]:
    """The gather nodes, in graph order."""
    return [n for n in graph.nodes if is_gather(n)]


def is_view(node: fx.Node) -> bool:
    """Whether `node` returns a view of its first argument."""
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    return node.op == "call_function" and node.target in _VIEW_TARGETS


def cast_dtype(node: fx.Node) -> torch.dtype | None:
    """The target dtype when `node` is a plain dtype cast of its first argument, else None."""
    if node.op == "call_method" and node.target == "to":
        if len(node.args) == 2 and not node.kwargs and isinstance(node.args[1], torch.dtype):
            return node.args[1]
        if len(node.args) == 1 and set(node.kwargs) == {"dtype"}:
            dtype = node.kwargs["dtype"]
            return dtype if isinstance(dtype, torch.dtype) else None
        return None
    if node.op != "call_function":
        return None
    if node.target is torch.ops.prims.convert_element_type.default:
        dtype = node.args[1]
        return dtype if isinstance(dtype, torch.dtype) else None
    if node.target is _aten._to_copy.default and set(node.kwargs) <= {"dtype", "layout", "device"}:
        dtype = node.kwargs.get("dtype")
        return dtype if isinstance(dtype, torch.dtype) else None
    return None


def aliases(node: fx.Node, position: Callable[[fx.Node], int] | None = None) -> list[fx.Node]:
    """`node` and every view of it (transitively), in graph order (`position`, if given,
    is each node's place in it, e.g. a `Positions` a pass keeps)."""
    found = {node}
    todo = [node]
    while todo:
        for user in todo.pop().users:
            if user not in found and is_view(user) and user.args[0] in found:
                found.add(user)
                todo.append(user)
    return sorted(found, key=position or order(node.graph).__getitem__)


def order(graph: fx.Graph) -> dict[fx.Node, int]:
    """Each node's position in the graph."""
    return {n: i for i, n in enumerate(graph.nodes)}


class Positions:
    """Each node's place in a graph, kept up to date through the moves made with
    `move_before` and `move_after` (for passes that move many nodes, renumbering the whole
    graph after each move is a large part of their time: docs/benchmarks.md,
    design-measurements). Only nodes that were in the graph when it was made have a
    place."""

    # Room between neighbours: each move into a gap halves it, so 32 moves into one gap
    # fit before a renumbering.
    _GAP = 1 << 32

    def __init__(self, graph: fx.Graph) -> None:
        self._graph = graph
        self._renumber()

    def __getitem__(self, node: fx.Node) -> int:
        return self._place[node]

    def move_before(self, node: fx.Node, anchor: fx.Node) -> None:
        """Move `node` to just before `anchor`."""
        anchor.prepend(node)
        self._settle(node)

    def move_after(self, node: fx.Node, anchor: fx.Node) -> None:
        """Move `node` to just after `anchor`."""
        anchor.append(node)
        self._settle(node)

    def _renumber(self) -> None:
        self._place = {n: i * self._GAP for i, n in enumerate(self._graph.nodes)}

    def _settle(self, node: fx.Node) -> None:
        # The graph's sentinel ("root") closes the list at both ends.
        lo = self._place[node.prev] if node.prev.op != "root" else -self._GAP
        hi = self._place[node.next] if node.next.op != "root" else lo + 2 * self._GAP
        if hi - lo < 2:
            self._renumber()
        else:
            self._place[node] = (lo + hi) // 2


def users_of(nodes: Iterable[fx.Node]) -> list[fx.Node]:
    """Every user of `nodes` that is not itself one of them."""
    inside = set(nodes)
    return [u for n in inside for u in n.users if u not in inside]


def nbytes(node: fx.Node) -> int:
    """Bytes of a gather's output, from its traced value or from its shard and arguments."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    shard, _, world, dtype = node.args[:4]
    assert isinstance(shard, fx.Node) and isinstance(world, int) and isinstance(dtype, torch.dtype)
    shard_val = shard.meta.get("val", shard.meta.get("example_value"))
    assert isinstance(shard_val, torch.Tensor), f"{node}: no traced shape to size it by"
    return shard_val.numel() * world * dtype.itemsize


def refresh_val(node: fx.Node) -> None:
    """(Re)compute `node.meta['val']` from its inputs' traced values (after a rewrite);
    nothing when the inputs carry none (a hand-built graph)."""
    if node.op != "call_function":
        return
    vals = [n.meta.get("val") for n in node.all_input_nodes]
    if not vals or not all(isinstance(v, torch.Tensor) for v in vals):
        return
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    target = node.target
    assert callable(target)
    mode = next((getattr(v, "fake_mode", None) for v in vals if hasattr(v, "fake_mode")), None)
    if mode is None:
        node.meta["val"] = target(*args, **kwargs)
        return
    with mode:
        node.meta["val"] = target(*args, **kwargs)
