"""Stages 1 and 2: which parameters make up each flat group, and in what order.

The one rule for `initialize()`, which builds the groups, and the planner, which counts
them: each `GroupKey`'s parameters are cut into runs of at most `reduce_bucket_bytes` in
reverse registration order, and the runs are ordered by when their gradients are ready.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn

from zeroshard.partition import GroupKey

Named = list[tuple[str, nn.Parameter]]


def _split_by_bytes(
    named: Sequence[tuple[str, nn.Parameter]], limit: int, itemsize: int
) -> list[Named]:
    """Consecutive runs of parameters of at most `limit` bytes (a big one stands alone)."""
    out: list[Named] = []
    size = 0
    for item in named:
        nbytes = item[1].numel() * itemsize
        if not out or size + nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(item)
        size += nbytes
    return out


def plan_buckets(
    model: nn.Module, grouped: Mapping[GroupKey, Named], bucket_bytes: int, itemsize: int
) -> list[tuple[GroupKey, Named]]:
    """The stage-1/2 flat groups of `model` (its parameters `grouped` by key, `itemsize`
    bytes per element), in the order their gradients become ready."""
    registration = {id(p): i for i, p in enumerate(model.parameters())}
    runs: list[tuple[int, GroupKey, Named]] = []
    for key, named in grouped.items():
        # Reverse registration order approximates the order gradients become ready.
        for run in _split_by_bytes(named[::-1], bucket_bytes, itemsize):
            runs.append((max(registration[id(p)] for _, p in run), key, run))
    runs.sort(key=lambda r: -r[0])
    return [(key, run) for _, key, run in runs]
