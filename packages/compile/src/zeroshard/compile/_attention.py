"""`drop_causal_masks`: attention with a constant causal mask becomes `is_causal=True`.

[Note: constant causal masks]
A model compiled whole may build its causal mask inside the graph: transformers (before
torch 2.14, where Dynamo reads `torch.compiler.is_exporting()` as True) never skips its
mask under `torch.compile`, so every `scaled_dot_product_attention` gets an explicit
boolean `attn_mask` and `is_causal=False`. With a mask, SDPA cannot use the flash kernels,
and its masked kernel is much slower (docs/benchmarks.md, design-measurements). A mask computed
from constants alone (no graph input among its ancestors) is the same on every call, so
the pass evaluates it once, at compile time; if it is the lower-triangular causal mask
(square, the same for every batch and head) the call becomes `is_causal=True` with no
mask, which SDPA defines as exactly that mask. A mask that depends on an input (padding),
that is not causal, or that draws random numbers is left alone.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode

from zeroshard.compile._graph import order
from zeroshard.compile._pipeline import PassContext

log = logging.getLogger("zeroshard.compile")

# F.scaled_dot_product_attention's parameters, in order (Dynamo keeps its call as is).
_SDPA_PARAMS = (
    "query",
    "key",
    "value",
    "attn_mask",
    "dropout_p",
    "is_causal",
    "scale",
    "enable_gqa",
)


class _NotConstant(Exception):
    """A mask's subgraph draws random numbers: not the same on every call."""


class _RefuseRandom(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if torch.Tag.nondeterministic_seeded in func.tags:
            raise _NotConstant(str(func))
        return func(*args, **(kwargs or {}))


def _is_sdpa(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is F.scaled_dot_product_attention


def _bound(node: fx.Node) -> dict[str, Any]:
    """The SDPA call's arguments by parameter name."""
    return {**dict(zip(_SDPA_PARAMS, node.args, strict=False)), **node.kwargs}


def _constant_subgraph(mask: fx.Node) -> list[fx.Node] | None:
    """`mask` and its ancestors in graph order, when all are calls on constants (no
    placeholder, attribute or submodule among them); else None."""
    found: set[fx.Node] = set()
    todo = [mask]
    while todo:
        node = todo.pop()
        if node in found:
            continue
        if node.op not in ("call_function", "call_method"):
            return None
        found.add(node)
        todo.extend(node.all_input_nodes)
    index = order(mask.graph)
    return sorted(found, key=index.__getitem__)


def _evaluate(nodes: list[fx.Node]) -> torch.Tensor | None:
    """The value of the last of `nodes` (a constant subgraph, in order), or None when it
    cannot be evaluated here or is random."""
    env: dict[fx.Node, Any] = {}
    try:
        with torch.no_grad(), _RefuseRandom():  # type: ignore[no-untyped-call]
            for node in nodes:
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                if node.op == "call_method":
                    obj, *rest = args
                    env[node] = getattr(obj, str(node.target))(*rest, **kwargs)
                else:
                    target = node.target
                    assert callable(target)
                    env[node] = target(*args, **kwargs)
    except Exception as e:  # a model's own code: leave the mask as it is, whatever failed
        log.debug("zeroshard.compile: mask %s not evaluated (%r)", nodes[-1], e)
        return None
    value = env[nodes[-1]]
    return value if isinstance(value, torch.Tensor) else None


def _shape(node: Any) -> torch.Size | None:
    """The traced shape of an argument (Dynamo's `example_value`), if it is a tensor node."""
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("example_value", node.meta.get("val"))
    return val.shape if isinstance(val, torch.Tensor) else None


def _is_causal(mask: torch.Tensor, query: torch.Size, key: torch.Size) -> bool:
    """Whether SDPA with `mask` is SDPA with `is_causal=True`: a square lower-triangular
    mask (bool: True attends; float: 0 attends, -inf does not), the same for every batch
    and head, whose batch dimensions do not widen the query's."""
    length = query[-2]
    if key[-2] != length or mask.dim() < 2 or tuple(mask.shape[-2:]) != (length, length):
        return False
    batch = list(zip(reversed(mask.shape[:-2]), reversed(query[:-2]), strict=False))
    if mask.dim() > len(query) or any(m not in (1, q) for m, q in batch):
        return False
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        allowed = mask == 0
        if not bool(torch.all(allowed | (mask == -math.inf))):
            return False
    else:
        return False
    causal = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    return torch.equal(allowed, causal.expand_as(allowed))


def drop_causal_masks(graph: fx.Graph, context: PassContext) -> None:
    """Replace every constant causal `attn_mask` of `scaled_dot_product_attention` by
    `is_causal=True`, so the flash kernels apply (see [Note: constant causal masks])."""
    # Each mask evaluated once, however many attention calls share it.
    values: dict[fx.Node, tuple[list[fx.Node], torch.Tensor] | None] = {}
    dropped: dict[fx.Node, list[fx.Node]] = {}  # mask: the nodes computing it
    for sdpa in [n for n in graph.nodes if _is_sdpa(n)]:
        bound = _bound(sdpa)
        mask, query, key = bound.get("attn_mask"), _shape(bound["query"]), _shape(bound["key"])
        if not isinstance(mask, fx.Node) or bound.get("is_causal") or query is None or key is None:
            continue
        if mask not in values:
            nodes = _constant_subgraph(mask)
            value = _evaluate(nodes) if nodes is not None else None
            values[mask] = None if nodes is None or value is None else (nodes, value)
        known = values[mask]
        if known is None or not _is_causal(known[1], query, key):
            continue
        rest = {k: v for k, v in bound.items() if k not in _SDPA_PARAMS[:3]}
        sdpa.args = (bound["query"], bound["key"], bound["value"])
        sdpa.kwargs = {**rest, "attn_mask": None, "is_causal": True}
        dropped[mask] = known[0]
    # What computed the dropped masks, unless something else still uses it: latest first.
    computed = {n for nodes in dropped.values() for n in nodes}
    index = order(graph)
    for node in sorted(computed, key=index.__getitem__, reverse=True):
        if not node.users and not node.is_impure():
            graph.erase_node(node)
    if dropped:
        log.debug("zeroshard.compile: %d constant causal mask(s) dropped", len(dropped))
