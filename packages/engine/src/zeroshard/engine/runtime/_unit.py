"""`Unit`: one stage-3 unit's parameters, and the one object that owns their life.

[Note: the life of a unit in one step]
pre_forward: gather (or wait for a prefetch already in flight) and expose the parameters
as views of the gathered buffers. post_forward: release, unless the unit is persistent
(small, or the root, whose head runs first in backward) or backward needs it first (the
last unit of forward, when a backward may follow: releasing it would only gather it
again at once, an all-gather nothing could prefetch). pre_backward (a gradient reached
the unit's outputs): gather again. grads_reduced: the reducer has queued the reduction of
one of the unit's flat groups; once all of its trainable groups are queued, the unit is
released (post-backward). backward_done: release what backward left gathered (a unit
whose parameters got no gradient this step). After the optimizer step every gathered unit
is dropped: its parameters changed. The runtime (`_stage3.Stage3Runtime`) decides when:
it owns the hooks, the recorded order and which units to prefetch.

Autograd may save parameters or views of them for backward; releasing only resizes the
gathered buffer's storage to zero (see [Note: released storage] in _flat_group.py), so
the memory is freed all the same, and backward re-gathers into the same storage before
anything reads it, which the pre-backward hook guarantees.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from torch import nn

from zeroshard.comm import Handle
from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._labels import phase
from zeroshard.engine.runtime._stats import EngineStats


class UnitState(Enum):
    """Where a unit's parameters are."""

    RELEASED = "released"
    GATHERING = "gathering"
    GATHERED = "gathered"


class Unit:
    """A module whose flat groups are gathered and released together.

    `check_gather` runs before each gather is issued (the runtime's check that every rank
    gathers the same unit, see [Note: divergent ranks]).
    """

    def __init__(
        self,
        index: int,
        name: str,
        module: nn.Module,
        groups: tuple[FlatParamGroup, ...],
        *,
        persistent: bool,
        stats: EngineStats,
        check_gather: Callable[[Unit], None],
    ) -> None:
        self.index = index
        self.name = name
        self.module = module
        self.groups = groups
        self.persistent = persistent
        self.state = UnitState.RELEASED
        self._stats = stats
        self._check_gather = check_gather
        self._handles: list[Handle] = []
        self._trainable = sum(1 for g in groups if g.trainable)
        self._reduced = 0
        # Bytes of the gathered buffers: fixed for the unit's life.
        self.nbytes = sum(g.layout.padded_numel * g.param_buffer.element_size() for g in groups)

    @property
    def label(self) -> str:
        """How errors name this unit."""
        return f"unit {self.index} ({self.name or '<root>'})"

    # -- gather and release --------------------------------------------------------------
    def start_gather(self, *, prefetch: bool = False) -> None:
        """Issue the all-gathers of a released unit (no wait)."""
        if self.state is not UnitState.RELEASED:
            return
        self._check_gather(self)
        with phase("zeroshard::gather"):
            self._handles = [g.start_gather() for g in self.groups]
        self.state = UnitState.GATHERING
        self._stats.gathered(self.nbytes, prefetch=prefetch)

    def gather(self) -> None:
        """Make the parameters whole (waiting for a prefetch in flight)."""
        if self.state is UnitState.GATHERED:
            return
        self.start_gather()
        self._wait()
        for g in self.groups:
            g.expose()
        self.state = UnitState.GATHERED

    def release(self) -> None:
        """Drop the gathered buffers (after finishing a gather still in flight)."""
        if self.state is UnitState.RELEASED:
            return
        self._wait()
        with phase("zeroshard::release"):
            for g in self.groups:
                g.release()
        self._stats.released(self.nbytes)
        self.state = UnitState.RELEASED

    def _wait(self) -> None:
        for h in self._handles:
            h.wait()
        self._handles = []

    # -- the step ------------------------------------------------------------------------
    def pre_forward(self) -> None:
        """Before the module runs: its parameters must be whole."""
        self.gather()

    def post_forward(self, *, keep: bool = False) -> None:
        """After the module ran: free what backward gathers again (persistent units stay,
        and with `keep` this one: backward needs it first)."""
        if not self.persistent and not keep:
            self.release()

    def pre_backward(self) -> None:
        """A gradient reached the unit's outputs: its parameters must be whole again."""
        self.gather()

    def grads_reduced(self, g: FlatParamGroup) -> None:
        """`g`'s gradients are all in and queued for reduction: once every trainable
        group of the unit is, backward is done with its parameters."""
        self._reduced += 1
        if self._reduced == self._trainable and not self.persistent:
            self.release()

    def backward_done(self) -> None:
        """End of backward: release what is still gathered (no gradient arrived for it)."""
        self._reduced = 0
        if not self.persistent:
            self.release()
