"""Stage 3 at run time: gather each unit before it runs, release it after, prefetch ahead.

[Note: the life of a unit in one step]
forward pre-hook: gather (or wait for a prefetch), expose the parameters as views of the
gathered buffer, then prefetch the next units of the recorded forward order.
forward post-hook: register a pre-backward hook on the outputs and release the unit
(unless it is persistent: small, or the root, whose head runs first in backward).
pre-backward hook (a gradient reached the unit's outputs): gather again, prefetch the
next units of the backward order. When all of a unit's gradients have arrived (the
reducer's `on_complete`), its reduction is queued and the unit is released; what is
still gathered at the end of backward is released there. After the optimizer step,
every gathered unit is dropped: its parameters changed.

Autograd may save parameters or views of them for backward; releasing only resizes the
gathered buffer's storage to zero (see [Note: released storage] in _flat_group.py), so
the memory is freed all the same, and backward re-gathers into the same storage before
anything reads it, which the pre-backward hook guarantees. Activation checkpointing
recomputes forward inside backward: there the forward hooks neither release nor
re-record (the unit stays gathered until its gradients are in).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from zeroshard.comm import Group, Handle
from zeroshard.engine._flat_group import FlatParamGroup

log = logging.getLogger("zeroshard.engine")


class UnitState(Enum):
    """Where a unit's parameters are."""

    RELEASED = "released"
    GATHERING = "gathering"
    GATHERED = "gathered"


@dataclass
class EngineStats:
    """Counters for tests and benchmarks (stage 3); reset with `reset()`."""

    gathers: int = 0
    bytes_gathered: int = 0
    live_bytes: int = 0
    peak_live_bytes: int = 0
    prefetches: int = 0
    order_changes: int = 0

    def reset(self) -> None:
        """Zero every counter but the live bytes (which describe the present)."""
        live = self.live_bytes
        for name in self.__dataclass_fields__:
            setattr(self, name, 0)
        self.live_bytes = self.peak_live_bytes = live


@dataclass(eq=False)
class Unit:
    """A module whose parameters are gathered and released together."""

    index: int
    name: str
    module: nn.Module
    groups: tuple[FlatParamGroup, ...]
    persistent: bool
    state: UnitState = UnitState.RELEASED
    handles: list[Handle] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes of the gathered buffers."""
        return sum(
            g.layout.padded_numel * g.param_buffer.element_size()
            for g in self.groups
            if g.param_buffer is not None
        )

    @property
    def label(self) -> str:
        """How errors name this unit."""
        return f"unit {self.index} ({self.name or '<root>'})"


class DivergentRanksError(RuntimeError):
    """Ranks disagree on which unit to gather: a rank skipped or reordered a module."""


def _in_backward() -> bool:
    return bool(torch._C._current_graph_task_id() != -1)


class Stage3Runtime:
    """Hooks and prefetch for the units of one model; see [Note: the life of a unit]."""

    def __init__(
        self,
        units: Sequence[Unit],
        *,
        world: Group,
        prefetch_depth: int,
        prefetch_bytes: int,
        max_live_bytes: int,
        on_new_order: Callable[[Sequence[Unit]], None],
    ) -> None:
        self.units = list(units)
        # The engine re-orders gradient reduction by each newly recorded forward order.
        self.on_new_order = on_new_order
        self.prefetch_depth = prefetch_depth
        self.prefetch_bytes = prefetch_bytes
        self.max_live_bytes = max_live_bytes
        self.stats = EngineStats()
        self._unit_of_group = {g.index: u for u in self.units for g in u.groups}
        self._order: list[Unit] = []
        self._position: dict[int, int] = {}
        self._recording: list[Unit] = []
        self._order_valid = False
        self._complete: dict[int, int] = {}
        # [Note: divergent ranks] Ranks must gather the same units in the same order. On
        # gloo (CPU) every gather is preceded by a tiny check collective, so a rank that
        # diverged gets an error naming both units before a mismatched gather can abort
        # the process. On NCCL a per-gather check would cost a host sync each time, so the
        # ids are hashed locally and compared once per step, before the optimizer step:
        # a mismatch never reaches the weights.
        self._world = world
        self._check_each = world.backend != "nccl"
        # This step's gathers, for the error message only: bounded, since eval loops that
        # never step (and so never verify) gather forever.
        self._sequence: deque[str] = deque(maxlen=64)
        self._hash = 0
        # False while something else (zeroshard.compile) gathers and releases: the hooks
        # then do nothing.
        self.hooks_enabled = True
        for u in self.units:
            u.module.register_forward_pre_hook(self._make_pre_forward(u))
            u.module.register_forward_hook(self._make_post_forward(u))

    # -- gather and release --------------------------------------------------------------
    def _check_same_unit(self, u: Unit) -> None:
        self._sequence.append(u.label)
        self._hash = (self._hash * 1_000_003 + u.index + 1) % (2**31 - 1)
        if not self._check_each or self._world.size == 1:
            return
        ids = torch.tensor([u.index, -u.index], dtype=torch.int64, device=self._world.device)
        self._world.all_reduce(ids, op="max", label=f"unit check before {u.label}").wait()
        if int(ids[0]) != u.index or int(-ids[1]) != u.index:
            others = sorted({int(ids[0]), int(-ids[1])} - {u.index})
            # Another rank may hold more units than this one (an extra layer): name it by index.
            names = ", ".join(
                self.units[i].label if 0 <= i < len(self.units) else f"unit {i}" for i in others
            )
            raise DivergentRanksError(
                f"rank {self._world.rank} is gathering {u.label} while another rank is "
                f"gathering {names}: the ranks ran different modules (a skipped or extra module?)"
            )

    def verify_order(self) -> None:
        """Compare this step's gather order across ranks (one collective); reset it."""
        sequence, digest = list(self._sequence), self._hash
        self._sequence.clear()
        self._hash = 0
        if self._check_each or self._world.size == 1:
            return
        t = torch.tensor([digest, -digest], dtype=torch.int64, device=self._world.device)
        self._world.all_reduce(t, op="max", label="unit order check").wait()
        if int(t[0]) != digest or int(-t[1]) != digest:
            raise DivergentRanksError(
                f"ranks gathered different units this step; rank {self._world.rank} gathered "
                "(last 64): " + ", ".join(sequence)
            )

    def _start(self, u: Unit, prefetch: bool) -> None:
        self._check_same_unit(u)
        u.handles = [g.start_gather() for g in u.groups]
        u.state = UnitState.GATHERING
        nbytes = u.nbytes
        self.stats.gathers += 1
        self.stats.prefetches += int(prefetch)
        self.stats.bytes_gathered += nbytes
        self.stats.live_bytes += nbytes
        self.stats.peak_live_bytes = max(self.stats.peak_live_bytes, self.stats.live_bytes)

    def gather(self, u: Unit) -> None:
        """Make `u`'s parameters whole (waiting for a prefetch in flight)."""
        if u.state is UnitState.GATHERED:
            return
        if u.state is UnitState.RELEASED:
            self._start(u, prefetch=False)
        for h in u.handles:
            h.wait()
        u.handles = []
        for g in u.groups:
            g.expose()
        u.state = UnitState.GATHERED

    def release(self, u: Unit) -> None:
        """Drop `u`'s gathered buffers (after finishing a gather still in flight)."""
        if u.state is UnitState.RELEASED:
            return
        for h in u.handles:
            h.wait()
        u.handles = []
        self.stats.live_bytes -= u.nbytes
        for g in u.groups:
            g.release()
        u.state = UnitState.RELEASED

    def release_all(self) -> None:
        """Drop every gathered unit (after a step: the shards changed)."""
        for u in self.units:
            self.release(u)

    def _prefetch(self, candidates: Sequence[Unit]) -> None:
        in_flight = 0
        for u in candidates:
            if u.state is not UnitState.RELEASED:
                continue
            nbytes = u.nbytes
            if in_flight + nbytes > self.prefetch_bytes:
                return
            if self.stats.live_bytes + nbytes > self.max_live_bytes:
                return
            self._start(u, prefetch=True)
            in_flight += nbytes

    # -- forward -------------------------------------------------------------------------
    def _make_pre_forward(self, u: Unit) -> Any:
        def pre_forward(module: nn.Module, args: Any) -> None:
            if not self.hooks_enabled:
                return
            if _in_backward():
                self.gather(u)  # recomputation under activation checkpointing
                return
            self._record(u)
            self.gather(u)
            if self._order_valid:
                pos = len(self._recording) - 1
                self._prefetch(self._order[pos + 1 : pos + 1 + self.prefetch_depth])

        return pre_forward

    def _record(self, u: Unit) -> None:
        position = len(self._recording)
        self._recording.append(u)
        if self._order_valid and (position >= len(self._order) or self._order[position] is not u):
            # A branch or generation changed the order: stop prefetching this step and
            # record the new order. Said once at debug level, not every step.
            self._order_valid = False
            self.stats.order_changes += 1
            if self.stats.order_changes == 1:
                log.debug("zeroshard: unit order changed at %s; re-recording", u.label)

    def _make_post_forward(self, u: Unit) -> Any:
        def post_forward(module: nn.Module, args: Any, output: Any) -> None:
            if not self.hooks_enabled or _in_backward():
                return
            if torch.is_grad_enabled():
                for t in tree_flatten(output)[0]:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(self._make_pre_backward(u))  # type: ignore[no-untyped-call]
            if u.index == 0:
                self._end_of_forward()
            if not u.persistent:
                self.release(u)

        return post_forward

    def _end_of_forward(self) -> None:
        # The root's forward wraps all others: the order recorded this step is complete.
        if not self._order_valid and self._recording:
            self._order = self._recording
            # A unit run twice keeps its last forward position (its first in backward).
            self._position = {u.index: i for i, u in enumerate(self._order)}
            self._order_valid = True
            self.on_new_order(self._order)
        self._recording = []

    # -- backward ------------------------------------------------------------------------
    def _make_pre_backward(self, u: Unit) -> Any:
        def pre_backward(grad: torch.Tensor) -> torch.Tensor:
            self.gather(u)
            pos = self._position.get(u.index) if self._order_valid else None
            if pos:
                self._prefetch(self._order[max(0, pos - self.prefetch_depth) : pos][::-1])
            return grad

        return pre_backward

    def on_group_complete(self, g: FlatParamGroup) -> None:
        """All of `g`'s gradients are in: release its unit once all its groups are."""
        u = self._unit_of_group[g.index]
        done = self._complete.get(u.index, 0) + 1
        self._complete[u.index] = done
        if done == sum(1 for x in u.groups if x.trainable) and not u.persistent:
            self.release(u)

    def on_backward_end(self) -> None:
        """Release what backward left gathered (units without gradients this step)."""
        self._complete.clear()
        for u in self.units:
            if not u.persistent:
                self.release(u)
