"""`save_tables`: values computed without the parameters are saved, not redone per layer.

[Note: tables]
A model compiled whole computes some values once, from buffers, shapes and inputs but
from no parameter: rotary cos/sin from the positions, a mask from the labels. Its layers
then broadcast them into much larger activations (`q * cos`). Left to itself, the
min-cut partitioner recomputes such a table in backward (it costs no saved memory) and
inductor, seeing a cheap pointwise value, inlines it into every consumer: each layer's
kernels compute cos and sin again for every element of q and k, forward and backward,
several times the time of the same kernels in blocks compiled one by one, which receive
cos/sin as inputs (docs/benchmarks.md, design-measurements). Tagged MUST_SAVE, the table is a
forward output: inductor computes it once into a buffer, every layer reads it, and
backward reads the saved copy.
A table is at most half the size of the forward activation it is broadcast into, so
saving it costs little next to the activations saved anyway.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from zeroshard.compile._graph import is_gather, is_view
from zeroshard.compile._pipeline import PassContext


def _is_tangent(node: fx.Node) -> bool:
    # AOTAutograd names the joint graph's inputs primals_* and tangents_*.
    return node.op == "placeholder" and str(node.target).startswith("tangents")


def _numel(node: fx.Node) -> int | None:
    val = node.meta.get("val")
    return val.numel() if isinstance(val, torch.Tensor) else None


def save_tables(graph: fx.Graph, context: PassContext) -> None:
    """Tag MUST_SAVE each value that depends on no parameter and no gradient and that
    forward broadcasts into an activation at least twice its size (see [Note: tables])."""
    weighted: set[fx.Node] = set()  # depends on a gathered parameter
    backward: set[fx.Node] = set()  # depends on a gradient
    for node in graph.nodes:
        inputs = node.all_input_nodes
        if is_gather(node) or any(a in weighted for a in inputs):
            weighted.add(node)
        if _is_tangent(node) or any(a in backward for a in inputs):
            backward.add(node)
    for node in graph.nodes:
        size = _numel(node)
        if node.op != "call_function" or node in weighted or node in backward or size is None:
            continue
        forward_uses = [_numel(u) for u in node.users if u in weighted and u not in backward]
        if not any(n is not None and 2 * size <= n for n in forward_uses):
            continue
        _base(node).meta["recompute"] = CheckpointPolicy.MUST_SAVE


def _base(node: fx.Node) -> fx.Node:
    """What `node` is a view of (through views that do not shrink it): the partitioner
    recomputes a view from its base whatever the view's tag, so the base is what to save."""
    while is_view(node) and isinstance(source := node.args[0], fx.Node):
        size, source_size = _numel(node), _numel(source)
        if source.op != "call_function" or size is None or source_size is None:
            break
        if source_size > size:  # a slice of a larger value: saving that would cost more
            break
        node = source
    return node
