"""Each graph pass on small hand-built aten-level graphs: which ops, in which order."""

from __future__ import annotations

import pytest
import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

import zeroshard.compile as zc

aten = torch.ops.aten
GATHER = torch.ops.zeroshard.gather.default
RELEASE = torch.ops.zeroshard.release.default
RS = torch.ops.zeroshard.reduce_scatter.default
WORLD = 2


def ctx(phase: zc.Phase = zc.Phase.FORWARD, prefetch: int = 0, persist: int = 0) -> zc.PassContext:
    return zc.PassContext(phase, prefetch, persist, 0)


def _val(node: fx.Node, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> fx.Node:
    node.meta["val"] = torch.empty(shape, dtype=dtype, device="meta")
    return node


def mlp_graph(
    n: int = 3,
    d: int = 4,
    cast: torch.dtype | None = None,
    gathers_first: bool = True,
    master: torch.dtype = torch.float32,
) -> fx.Graph:
    """x -> mm(w0) -> relu -> mm(w1) -> ... with each w a view of its own gathered shard
    (of `master` dtype); with `cast`, each weight view is cast to that dtype before use.
    Gathers (and views) all at the top when `gathers_first`, as capture leaves them."""
    g = fx.Graph()
    shards = [_val(g.placeholder(f"shard{i}"), (d * d // WORLD,), master) for i in range(n)]
    h = _val(g.placeholder("x"), (d, d), cast or master)
    weights = []
    for i in range(n):
        full = _val(
            g.call_function(GATHER, (shards[i], i, WORLD, master, torch.float32)),
            (d * d,),
            master,
        )
        w = _val(g.call_function(aten.view.default, (full, [d, d])), (d, d), master)
        if cast is not None:
            w = _val(
                g.call_function(torch.ops.prims.convert_element_type.default, (w, cast)),
                (d, d),
                cast,
            )
        weights.append(w)
    for i in range(n):
        h = _val(g.call_function(aten.mm.default, (h, weights[i])), (d, d), cast or master)
        h = _val(g.call_function(aten.relu.default, (h,)), (d, d), cast or master)
    g.output((h,))
    if not gathers_first:
        zc.gather_at_first_use(g, ctx())
    g.lint()
    return g


def names(graph: fx.Graph) -> list[str]:
    return [
        str(n.target).split(".")[-2] if "zeroshard" in str(n.target) else n.name
        for n in graph.nodes
    ]


def kinds(graph: fx.Graph) -> list[str]:
    """The graph as a list of short op names (placeholders and views left out)."""
    out = []
    for n in graph.nodes:
        if n.op == "call_function":
            name = str(n.target).split(".")
            out.append(name[-2] if name[-1] in ("default", "Tensor") else name[-1])
    return [k for k in out if k != "view"]


def gather_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.target is GATHER]


def test_fuse_downcast_gathers_in_the_compute_dtype() -> None:
    g = mlp_graph(cast=torch.bfloat16)
    zc.fuse_downcast(g, ctx())
    g.lint()
    assert [n.args[3] for n in gather_nodes(g)] == [torch.bfloat16] * 3
    assert all(n.meta["val"].dtype == torch.bfloat16 for n in gather_nodes(g))
    assert "convert_element_type" not in kinds(g)  # no fp32 copy, no cast left
    mm = [n for n in g.nodes if n.target is aten.mm.default]
    assert all(m.args[1].meta["val"].dtype == torch.bfloat16 for m in mm)


def test_fuse_downcast_leaves_an_upcast_after_the_gather() -> None:
    # bf16 masters whose every use is an fp32 upcast (torchao's fp8 scaling): gathering
    # in fp32 would move twice the bytes, so the gather stays bf16 and the casts stay.
    g = mlp_graph(cast=torch.float32, master=torch.bfloat16)
    zc.fuse_downcast(g, ctx())
    assert [n.args[3] for n in gather_nodes(g)] == [torch.bfloat16] * 3
    assert kinds(g).count("convert_element_type") == 3


def test_fuse_downcast_keeps_full_precision_when_some_use_needs_it() -> None:
    g = mlp_graph(cast=torch.bfloat16)
    first = gather_nodes(g)[0]
    view = next(iter(first.users))
    # A second, fp32 use of the same weight: the gather must stay fp32.
    with g.inserting_before(next(n for n in g.nodes if n.op == "output")):
        _val(g.call_function(aten.sum.default, (view,)), ())
    zc.fuse_downcast(g, ctx())
    assert [n.args[3] for n in gather_nodes(g)] == [torch.float32, torch.bfloat16, torch.bfloat16]


def test_gather_at_first_use_moves_gathers_before_their_use() -> None:
    g = mlp_graph()
    assert kinds(g)[:3] == ["gather"] * 3
    zc.gather_at_first_use(g, ctx())
    g.lint()
    assert kinds(g) == ["gather", "mm", "relu"] * 3


def test_insert_releases_then_free_early_release_after_last_use() -> None:
    g = mlp_graph(gathers_first=False)
    zc.insert_releases(g, ctx())
    g.lint()
    # Correct but late: every buffer released just before the output.
    assert kinds(g) == ["gather", "mm", "relu"] * 3 + ["release"] * 3
    zc.free_early(g, ctx())
    g.lint()
    assert kinds(g) == ["gather", "mm", "release", "relu"] * 3
    for release in (n for n in g.nodes if n.target is RELEASE):
        assert release.prev.target is aten.mm.default  # the weight's only (last) use


def test_insert_releases_skips_buffers_that_escape() -> None:
    g = mlp_graph(gathers_first=False)
    output = next(n for n in g.nodes if n.op == "output")
    output.update_arg(0, (*output.args[0], next(iter(gather_nodes(g)[1].users))))
    zc.insert_releases(g, ctx())
    released = [n.args[0] for n in g.nodes if n.target is RELEASE]
    assert released == [gather_nodes(g)[0], gather_nodes(g)[2]]


def test_free_early_moves_reduce_scatter_up_to_its_gradient() -> None:
    g = fx.Graph()
    grad = _val(g.placeholder("grad"), (8,))
    late = _val(g.placeholder("late"), (4,))
    cast = _val(g.call_function(aten._to_copy.default, (grad,), {"dtype": torch.float32}), (8,))
    work = _val(g.call_function(aten.relu.default, (late,)), (4,))
    work = _val(g.call_function(aten.relu.default, (work,)), (4,))
    rs = _val(g.call_function(RS, (cast, 0, WORLD)), (4,))
    g.output((rs, work))
    # The cast sits early already; the reduce-scatter moves up right after it.
    zc.free_early(g, ctx(zc.Phase.BACKWARD))
    g.lint()
    assert kinds(g) == ["_to_copy", "reduce_scatter", "relu", "relu"]


def test_free_early_puts_a_gradient_made_from_nothing_after_the_placeholders() -> None:
    g = fx.Graph()
    late = _val(g.placeholder("late"), (4,))
    other = _val(g.placeholder("other"), (4,))
    work = _val(g.call_function(aten.relu.default, (late,)), (4,))
    zeros = _val(g.call_function(aten.zeros.default, ([8],)), (8,))
    rs = _val(g.call_function(RS, (zeros, 0, WORLD)), (4,))
    g.output((rs, work, other))
    zc.free_early(g, ctx(zc.Phase.BACKWARD))
    g.lint()
    assert [n.op for n in g.nodes][:2] == ["placeholder"] * 2
    assert kinds(g) == ["zeros", "reduce_scatter", "relu"]


def test_prefetch_within_budget_only() -> None:
    one = 4 * 4 * 4  # bytes of one gathered fp32 4x4 weight
    unit = ["gather", "mm", "release", "relu"]
    for budget, expected in [
        # No budget: each weight is gathered at its first use.
        (0, unit * 3),
        # Room for one buffer: the next is gathered as soon as the previous is released.
        (one, [*unit[:3], "gather", "relu", *unit[1:3], "gather", "relu", *unit[1:]]),
        # Room for two: the second right after the first, the third after the first's release.
        (2 * one, ["gather", *unit[:3], "gather", "relu", *unit[1:], *unit[1:]]),
    ]:
        g = mlp_graph(gathers_first=False)
        zc.insert_releases(g, ctx())
        zc.free_early(g, ctx())
        zc.prefetch(g, ctx(prefetch=budget))
        g.lint()
        assert kinds(g) == expected, budget


def test_mark_recompute_persists_the_last_gathers_within_budget() -> None:
    one = 4 * 4 * 2  # a weight is kept in the dtype it is used in: bf16
    g = mlp_graph(cast=torch.bfloat16)
    zc.mark_recompute(g, ctx(zc.Phase.JOINT, persist=one))
    policies = [n.meta.get("recompute") for n in gather_nodes(g)]
    assert policies == [CheckpointPolicy.MUST_RECOMPUTE] * 2 + [CheckpointPolicy.MUST_SAVE]
    first = gather_nodes(g)[0]
    chain = [first, *first.users, *next(iter(first.users)).users]
    assert {n.meta["recompute"] for n in chain} == {CheckpointPolicy.MUST_RECOMPUTE}
    mm = next(n for n in g.nodes if n.target is aten.mm.default)
    assert "recompute" not in mm.meta


def test_pipeline_order_phases_and_edits() -> None:
    seen: list[str] = []

    def mine(graph: fx.Graph, context: zc.PassContext) -> None:
        seen.append(context.phase.value)

    base = zc.default_pipeline()
    assert [s.name for s in base] == [
        "drop_causal_masks",
        "mark_recompute",
        "save_tables",
        "fuse_downcast",
        "gather_at_first_use",
        "insert_releases",
        "free_early",
        "prefetch",
        "issue_async",
    ]
    extended = base.without("prefetch", "issue_async").append(mine, {zc.Phase.BACKWARD})
    assert [s.name for s in extended][-2:] == ["free_early", "mine"]
    assert [s.name for s in base][-1] == "issue_async"  # pipelines are immutable
    g = mlp_graph()
    extended.run(g, ctx(zc.Phase.FORWARD))
    assert seen == []
    extended.run(g, ctx(zc.Phase.BACKWARD))
    assert seen == ["backward"]
    assert kinds(g).count("release") == 3
    with pytest.raises(ValueError, match="no pass named"):
        base.without("nonexistent")


def test_positions_follow_moves_through_renumbering() -> None:
    """`Positions` agrees with the graph's order after every move, including moves into one
    gap until it is used up (which renumbers the graph)."""
    import random

    from zeroshard.compile._graph import Positions

    g = mlp_graph(n=4)
    place = Positions(g)
    nodes = [n for n in g.nodes if n.op not in ("placeholder", "output")]
    rng = random.Random(0)
    # Moves that ignore data dependencies: Positions tracks the list, not what it means.
    moves = [(rng.choice(nodes), rng.choice(nodes), rng.random() < 0.5) for _ in range(200)]
    # 60 moves into the gap just before one node, each halving it: past the 32 halvings
    # its room allows, so the graph is renumbered on the way.
    anchor = nodes[len(nodes) // 2]
    others = [n for n in nodes if n is not anchor]
    moves += [(others[i % len(others)], anchor, True) for i in range(60)]
    for node, target, before in moves:
        if node is target:
            continue
        (place.move_before if before else place.move_after)(node, target)
        # Sorted from the reverse, so that two nodes given one place fail too.
        ranked = sorted(reversed(list(g.nodes)), key=place.__getitem__)
        assert ranked == list(g.nodes), "out of order"
