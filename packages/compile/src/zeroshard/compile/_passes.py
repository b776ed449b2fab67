"""The graph passes of the default pipeline, each a plain `(graph, context) -> None`.

[Note: the order of the passes]
CAPTURE: `drop_causal_masks` turns attention with a constant causal mask into
`is_causal=True` while attention is still one call (AOTAutograd picks its kernel).
JOINT: `mark_recompute` tags every gather and its views and casts (autocast's included)
MUST_RECOMPUTE, except the ones the persistence budget keeps (MUST_SAVE), so that the
partitioner gathers again in backward instead of saving gathered parameters for it;
`save_tables` tags MUST_SAVE what forward computes without any parameter and broadcasts
into larger activations (rotary cos/sin), so it is computed once, not in every layer.
FORWARD / BACKWARD: `fuse_downcast` first (it changes gather sizes, which the budgets
below read), `gather_at_first_use` sinks each gather to just before it is needed,
`insert_releases` gives every gathered buffer one release, `free_early` moves each
release up to just after the buffer's last use, and `prefetch` finally hoists gathers
ahead of the previous unit's compute while the live gathered bytes stay in budget.
"""

from __future__ import annotations

import collections
import itertools

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from zeroshard.compile._async import issue_async
from zeroshard.compile._attention import drop_causal_masks
from zeroshard.compile._graph import (
    Positions,
    aliases,
    cast_dtype,
    gathers,
    is_float8_gather,
    is_gather,
    is_reduce_scatter,
    is_release,
    nbytes,
    order,
    refresh_val,
    users_of,
)
from zeroshard.compile._pipeline import FORWARD_AND_BACKWARD, PassContext, Phase, Pipeline
from zeroshard.compile._tables import save_tables

_RELEASE = torch.ops.zeroshard.release.default


def _chain(gather: fx.Node) -> list[fx.Node]:
    """The gather, its views, and casts of those (the nodes cheap to redo in backward)."""
    found = set(aliases(gather))
    for node in list(found):
        for user in node.users:
            if cast_dtype(user) is not None:
                found.update(aliases(user))
    index = order(gather.graph)
    return sorted(found, key=index.__getitem__)


def mark_recompute(graph: fx.Graph, context: PassContext) -> None:
    """Tag gathers and their views/casts for recomputation in backward, except the last
    ones gathered in forward while their bytes fit `context.persist_bytes` (those stay
    gathered from forward into backward: selective persistence)."""
    budget = context.persist_bytes
    index = order(graph)

    def first_use(gather: fx.Node) -> int:
        return min((index[u] for u in users_of(_chain(gather))), default=len(index))

    # Capture leaves every gather at the top: rank them by first use. The last used in
    # forward are the first needed in backward: persist those first.
    for gather in sorted(gathers(graph), key=first_use, reverse=True):
        chain = _chain(gather)
        # What is kept is the buffer in the dtype it is used in (fuse_downcast gathers in it).
        dtype = gather.args[3]
        assert isinstance(dtype, torch.dtype)
        used = [d for d in map(cast_dtype, chain) if d is not None]
        itemsize = min([dtype.itemsize, *(d.itemsize for d in used)])
        size = nbytes(gather) // dtype.itemsize * itemsize
        keep = size <= budget
        if keep:
            budget -= size
        policy = CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.MUST_RECOMPUTE
        for node in chain:
            node.meta["recompute"] = policy


def fuse_downcast(graph: fx.Graph, context: PassContext) -> None:
    """Gather in the dtype the parameters are used in: when every use of a gathered buffer
    (through views) is a cast to one narrower dtype, the gather casts the shard instead, so
    fewer bytes travel and no full-precision copy of the parameters is ever made. A wider
    cast stays after the gather (bf16 masters upcast by torchao's fp8 scaling: gathering
    fp32 would move twice the bytes). An fp8 gather is fused already (its buffer's casts
    are torchao's dequantization, not a downcast)."""
    for gather in gathers(graph):
        if is_float8_gather(gather):
            continue
        views = aliases(gather)
        leaves = users_of(views)
        dtypes = {cast_dtype(u) for u in leaves}
        if not leaves or len(dtypes) != 1:
            continue
        (target,) = dtypes
        gathered = gather.args[3]
        assert isinstance(gathered, torch.dtype)
        if target is None or target.itemsize >= gathered.itemsize:
            continue
        gather.update_arg(3, target)
        for node in views:
            refresh_val(node)
        for cast in leaves:
            source = cast.args[0]
            assert isinstance(source, fx.Node)
            cast.replace_all_uses_with(source)
            graph.erase_node(cast)


def gather_at_first_use(graph: fx.Graph, context: PassContext) -> None:
    """Move each gather (with its views) to just before the first node that needs it."""
    place = Positions(graph)
    for gather in gathers(graph):
        # Latest first: a view moves before its first user, then what it views before it.
        for node in reversed(aliases(gather, place.__getitem__)):
            if node.users:
                first = min(node.users, key=place.__getitem__)
                if node.next is not first:
                    place.move_before(node, first)


def insert_releases(graph: fx.Graph, context: PassContext) -> None:
    """Give every gathered buffer that does not escape the graph one `release`, placed just
    before the output (correct but late; `free_early` moves it up)."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    for gather in gathers(graph):
        views = aliases(gather)
        users = users_of(views)
        if output in users or any(is_release(u) for u in users):
            continue  # returned (saved for backward) or already released
        with graph.inserting_before(output):
            graph.call_function(_RELEASE, (gather, gather.args[1]))


def _hoist(graph: fx.Graph, movable: set[fx.Node]) -> None:
    """Move each node of `movable` up to just after the latest of its inputs (after the
    placeholders when it has none, e.g. a `zeros`); the other nodes keep their order.

    One walk over the graph (a pass over a model of many layers must not be quadratic):
    a movable node is emitted as soon as its last input is."""
    nodes = list(graph.nodes)
    waiting = {n: len(n.all_input_nodes) for n in movable}
    emitted: list[fx.Node] = []

    def emit(node: fx.Node) -> None:
        ready = collections.deque([node])
        while ready:
            n = ready.popleft()
            emitted.append(n)
            for user in n.users:
                if user in waiting:
                    waiting[user] -= 1
                    if waiting[user] == 0:
                        ready.append(user)

    inputless = [n for n in nodes if waiting.get(n) == 0]
    last_placeholder = max((i for i, n in enumerate(nodes) if n.op == "placeholder"), default=-1)
    if last_placeholder < 0:
        for n in inputless:
            emit(n)
    for i, node in enumerate(nodes):
        if node not in movable:
            emit(node)
        if i == last_placeholder:
            for n in inputless:
                emit(n)
    assert len(emitted) == len(nodes), "a movable node has an input outside the graph"
    if emitted[0] is not nodes[0]:
        nodes[0].prepend(emitted[0])
    for previous, node in itertools.pairwise(emitted):
        if previous.next is not node:
            previous.append(node)


def _ancestors(node: fx.Node) -> set[fx.Node]:
    """Every node `node` depends on (placeholders excluded)."""
    found: set[fx.Node] = set()
    todo = list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n not in found and n.op != "placeholder":
            found.add(n)
            todo.extend(n.all_input_nodes)
    return found


def free_early(graph: fx.Graph, context: PassContext) -> None:
    """Free gathered and gradient buffers as soon as possible: move each reduce-scatter,
    with what computes its full gradient, to as soon as its inputs allow (that gradient
    then dies there rather than at the end of backward), then each release to just after
    the last use of its buffer or any view of it."""
    # Gathers stay where `gather_at_first_use` (or `prefetch`) put them.
    gathered = {a for g in gathers(graph) for a in aliases(g)}
    for rs in [n for n in graph.nodes if is_reduce_scatter(n)]:
        _hoist(graph, (_ancestors(rs) | {rs}) - gathered)
    place = Positions(graph)
    for release in [n for n in graph.nodes if is_release(n)]:
        gather = release.args[0]
        assert isinstance(gather, fx.Node)
        uses = [u for u in users_of(aliases(gather, place.__getitem__)) if u is not release]
        last = max(uses, key=place.__getitem__, default=None)
        anchor = last if last is not None else gather
        if anchor.next is not release:
            place.move_after(release, anchor)


def _live_bytes(graph: fx.Graph) -> list[int]:
    """Gathered bytes live after each node (a gather adds, its release subtracts)."""
    live, out = 0, []
    size: dict[fx.Node, int] = {}
    for node in graph.nodes:
        if is_gather(node):
            size[node] = nbytes(node)
            live += size[node]
        elif is_release(node):
            gather = node.args[0]
            assert isinstance(gather, fx.Node)
            live -= size.get(gather, 0)
        out.append(live)
    return out


def prefetch(graph: fx.Graph, context: PassContext) -> None:
    """Issue each gather as early as the budget allows, but not before the previous one:
    the gathered bytes live at every node it moves ahead of, plus its own, must stay
    within `context.prefetch_bytes`. Gathers keep their order (every rank issues the same
    collectives in the same order)."""
    found = gathers(graph)
    for previous, gather in itertools.pairwise(found):
        index = order(graph)
        lo, hi = index[previous], index[gather]
        size = nbytes(gather)
        live = _live_bytes(graph)
        inputs = [index[a] for a in gather.all_input_nodes]
        earliest = max([lo, *inputs])
        best = hi - 1
        peak = 0
        # Walk back from the gather: `live[p]` is what is live while a gather placed after
        # node p would run and hold its buffer.
        for p in range(hi - 1, earliest - 1, -1):
            peak = max(peak, live[p])
            if peak + size > context.prefetch_bytes:
                break
            best = p
        if best < hi - 1:
            list(graph.nodes)[best].append(gather)


def default_pipeline() -> Pipeline:
    """The passes `compile()` runs unless given another pipeline (see [Note: the order of
    the passes])."""
    return (
        Pipeline()
        .append(drop_causal_masks, {Phase.CAPTURE})
        .append(mark_recompute, {Phase.JOINT})
        .append(save_tables, {Phase.JOINT})
        .append(fuse_downcast, FORWARD_AND_BACKWARD)
        .append(gather_at_first_use, FORWARD_AND_BACKWARD)
        .append(insert_releases, FORWARD_AND_BACKWARD)
        .append(free_early, FORWARD_AND_BACKWARD)
        .append(prefetch, FORWARD_AND_BACKWARD)
        .append(issue_async, FORWARD_AND_BACKWARD)
    )
