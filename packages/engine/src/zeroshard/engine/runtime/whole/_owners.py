"""Which rank of its flat group's process group steps each whole matrix (its owner).

Shapes are enough (a model on the meta device will do), so `initialize` and the planner
call the same `plan_owners` and cannot disagree. The matrices of every flat group on one
process group are balanced together (stage 3's units too), by Newton-Schulz FLOPs: the
largest first, each to the rank with the least work so far, ties to the rank that holds
most of it in its shard (then the lowest rank). The same on every rank: the layouts are.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from zeroshard.partition import FlatLayout, GroupKey

# torch.optim.Muon's default number of Newton-Schulz iterations.
DEFAULT_NS_STEPS = 5


def newton_schulz_flops(shape: tuple[int, ...], steps: int = DEFAULT_NS_STEPS) -> int:
    """FLOPs of `steps` quintic Newton-Schulz iterations on a matrix of `shape` (its first
    dimension by the rest): per iteration X X^T, its square and the product with X."""
    rows = shape[0] if shape else 1
    cols = math.prod(shape) // max(rows, 1)
    a, b = min(rows, cols), max(rows, cols)
    return steps * (4 * a * a * b + 2 * a**3)


@dataclass(frozen=True)
class WholeMatrix:
    """One matrix to own: its name, shape, Newton-Schulz FLOPs and how many of its elements
    each rank's shard holds."""

    name: str
    shape: tuple[int, ...]
    flops: int
    held: tuple[int, ...]


@dataclass(frozen=True)
class MatrixOwners:
    """The owner (a rank of a process group of `size` ranks) of each matrix, by name."""

    size: int
    owner: Mapping[str, int]
    matrices: tuple[WholeMatrix, ...]

    def loads(self) -> tuple[int, ...]:
        """Newton-Schulz FLOPs per rank."""
        out = [0] * self.size
        for m in self.matrices:
            out[self.owner[m.name]] += m.flops
        return tuple(out)

    @property
    def balance(self) -> float:
        """The busiest rank's FLOPs over the mean (1.0: even; 1.0 with nothing to own)."""
        loads = self.loads()
        mean = sum(loads) / self.size
        return max(loads) / mean if mean else 1.0


def assign_owners(matrices: Iterable[WholeMatrix], size: int) -> MatrixOwners:
    """Greedy, largest first: each matrix to the least loaded rank (ties: the rank holding
    most of it, then the lowest)."""
    ordered = sorted(matrices, key=lambda m: (-m.flops, m.name))
    load = [0] * size
    owner: dict[str, int] = {}
    for m in ordered:
        r = min(range(size), key=lambda r: (load[r], -m.held[r], r))
        owner[m.name] = r
        load[r] += m.flops
    return MatrixOwners(size, owner, tuple(ordered))


def layout_matrices(layout: FlatLayout, ns_steps: int) -> list[WholeMatrix]:
    """The matrices of a flat group laid out as `layout`, each with its held elements."""
    out = []
    for s in layout.slots:
        held = [0] * layout.world_size
        for piece in layout.pieces(s):
            held[piece.rank] += piece.numel
        out.append(
            WholeMatrix(s.name, s.shape, newton_schulz_flops(s.shape, ns_steps), tuple(held))
        )
    return out


def plan_owners(
    groups: Iterable[tuple[GroupKey, FlatLayout]], ns_steps: Mapping[int, int]
) -> dict[str, MatrixOwners]:
    """Owners of the matrices of the trainable flat groups whose optimizer param group is
    a whole-matrix one (`ns_steps`: those param groups' Newton-Schulz iterations), per
    process group (its `GroupKey.process_group` label)."""
    matrices: dict[str, list[WholeMatrix]] = {}
    sizes: dict[str, int] = {}
    for key, layout in groups:
        if not key.requires_grad or key.param_group not in ns_steps:
            continue
        label = key.process_group
        sizes[label] = layout.world_size
        matrices.setdefault(label, []).extend(layout_matrices(layout, ns_steps[key.param_group]))
    return {label: assign_owners(ms, sizes[label]) for label, ms in matrices.items()}
