"""`Pipeline`: the ordered graph passes a compiled model runs, which users can extend.

A pass is a plain function `(graph, context) -> None` that edits the graph in place.
Each step of a pipeline names the phases it runs in:
- CAPTURE: Dynamo's torch-level graph of forward, before AOTAutograd traces backward;
- JOINT: AOTAutograd's aten-level joint forward+backward graph, before it is split
  into forward and backward (recompute/save tags set here steer that split; autocast's
  casts exist from here on);
- FORWARD and BACKWARD: the aten-level graphs AOTAutograd hands to the compiler.

`run` is timed under `PASSES_KEY` in torch's own compile-time metrics
(`torch._dynamo.utils.compile_times()`), next to Dynamo's, AOTAutograd's and inductor's
phases, so a compile's seconds can be split between them and these passes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from enum import Enum

from torch import fx
from torch._dynamo.utils import dynamo_timed

# The name the passes' time is recorded under in torch's compile-time metrics.
PASSES_KEY = "zeroshard.compile passes"


class Phase(Enum):
    """Which graph a pass sees."""

    CAPTURE = "capture"
    JOINT = "joint"
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True)
class PassContext:
    """What a pass may consult: the phase, the memory budgets and the size up to which
    adjacent gathers are fused into one collective (bytes)."""

    phase: Phase
    prefetch_bytes: int
    persist_bytes: int
    fuse_bytes: int


GraphPass = Callable[[fx.Graph, PassContext], None]

FORWARD_AND_BACKWARD = frozenset({Phase.FORWARD, Phase.BACKWARD})


@dataclass(frozen=True)
class Step:
    """One pass and the phases it runs in."""

    fn: GraphPass
    phases: frozenset[Phase]

    @property
    def name(self) -> str:
        """The pass's function name."""
        return getattr(self.fn, "__name__", repr(self.fn))


@dataclass(frozen=True)
class Pipeline:
    """Passes applied in order; `append`/`insert`/`without` return a new pipeline."""

    steps: tuple[Step, ...] = ()

    def append(self, fn: GraphPass, phases: Iterable[Phase] = FORWARD_AND_BACKWARD) -> Pipeline:
        """This pipeline with `fn` run last in `phases`."""
        return Pipeline((*self.steps, Step(fn, frozenset(phases))))

    def insert(
        self, index: int, fn: GraphPass, phases: Iterable[Phase] = FORWARD_AND_BACKWARD
    ) -> Pipeline:
        """This pipeline with `fn` at position `index` in `phases`."""
        steps = list(self.steps)
        steps.insert(index, Step(fn, frozenset(phases)))
        return Pipeline(tuple(steps))

    def without(self, *names: str) -> Pipeline:
        """This pipeline without the passes named `names` (e.g. "fuse_downcast")."""
        unknown = set(names) - {s.name for s in self.steps}
        if unknown:
            raise ValueError(
                f"no pass named {sorted(unknown)} in this pipeline; it has "
                f"{[s.name for s in self.steps]}"
            )
        return Pipeline(tuple(s for s in self.steps if s.name not in names))

    def __iter__(self) -> Iterator[Step]:
        return iter(self.steps)

    def run(self, graph: fx.Graph, context: PassContext) -> None:
        """Apply every step that runs in `context.phase`, in order, then lint the graph."""
        with dynamo_timed(PASSES_KEY):
            for step in self.steps:
                if context.phase in step.phases:
                    step.fn(graph, context)
            graph.lint()
