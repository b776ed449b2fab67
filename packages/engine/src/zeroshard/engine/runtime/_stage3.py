"""Stage 3 at run time: the hooks that drive each `Unit` through a step, and prefetch.

The runtime registers a forward pre- and post-hook on every unit's module and a
pre-backward hook on its outputs, and calls the unit's lifecycle methods from them (see
[Note: the life of a unit in one step] in _unit.py). It records the order units run in
forward, prefetches the next units of that order (in forward) or of its reverse (in
backward) within the byte budgets, gives the reducer its launch order, and checks that
every rank gathers the same units. Activation checkpointing recomputes forward inside
backward: there the forward hooks neither release nor re-record (the unit stays gathered
until its gradients are in).

It is the stage-3 side of the two small protocols the reducer and the optimizer take:
`BackwardEvents` (launch order, reduction queued, end of backward) and `StepHooks`
(before the optimizer step, after the new shards are published).
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from zeroshard.comm import Group
from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._hooks import prepend_forward_pre_hook
from zeroshard.engine.runtime._prefetch import PrefetchBudget
from zeroshard.engine.runtime._stats import EngineStats
from zeroshard.engine.runtime._unit import Unit, UnitState
from zeroshard.engine.runtime._unit_plan import UnitPlan, is_persistent

log = logging.getLogger("zeroshard.engine")


class DivergentRanksError(RuntimeError):
    """Ranks disagree on which unit to gather: a rank skipped or reordered a module."""


def _in_backward() -> bool:
    return bool(torch._C._current_graph_task_id() != -1)


class Stage3Runtime:
    """Hooks, order and prefetch for the units of one model."""

    def __init__(
        self,
        plans: Sequence[tuple[UnitPlan, tuple[FlatParamGroup, ...]]],
        *,
        shard_group: Group,
        prefetch_depth: int,
        prefetch_bytes: int,
        max_live_bytes: int,
        persistence_threshold: int,
        stats: EngineStats,
    ) -> None:
        self.stats = stats
        self.units = [
            Unit(
                i,
                plan.name,
                plan.module,
                groups,
                persistent=is_persistent(
                    i, sum(g.layout.numel for g in groups), persistence_threshold
                ),
                stats=self.stats,
                check_gather=self._check_same_unit,
            )
            for i, (plan, groups) in enumerate(plans)
        ]
        self.prefetch = PrefetchBudget(prefetch_depth, prefetch_bytes, max_live_bytes)
        self._unit_of_group = {g.index: u for u in self.units for g in u.groups}
        self._order: list[Unit] = []
        self._position: dict[int, int] = {}
        self._recording: list[Unit] = []
        self._order_valid = False
        self._reduce_order = self._launch_order([])
        # [Note: divergent ranks] Ranks must gather the same units in the same order. On
        # gloo (CPU) every gather is preceded by a tiny check collective, so a rank that
        # diverged gets an error naming both units before a mismatched gather can abort
        # the process. On NCCL a per-gather check would cost a host sync each time, so the
        # ids are hashed locally and compared once per step, before the optimizer step:
        # a mismatch never reaches the weights.
        self._shard_group = shard_group
        self._check_each = shard_group.backend != "nccl"
        # This step's gathers, for the error message only: bounded, since eval loops that
        # never step (and so never verify) gather forever.
        self._sequence: deque[str] = deque(maxlen=64)
        self._hash = 0
        self._suspended = False
        for u in self.units:
            # In front of every hook already on the module: the unit is gathered before
            # anything of its forward reads its parameters (the fp8 wires' hooks, built
            # with the groups, read the gathered buffer).
            prepend_forward_pre_hook(u.module, self._make_pre_forward(u))
            u.module.register_forward_hook(self._make_post_forward(u))

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """The hooks do nothing inside: something else (zeroshard.compile) gathers and
        releases the parameters itself."""
        was, self._suspended = self._suspended, True
        try:
            yield
        finally:
            self._suspended = was

    # -- the order check -----------------------------------------------------------------
    def _check_same_unit(self, u: Unit) -> None:
        self._sequence.append(u.label)
        self._hash = (self._hash * 1_000_003 + u.index + 1) % (2**31 - 1)
        group = self._shard_group
        if not self._check_each or group.size == 1:
            return
        ids = torch.tensor([u.index, -u.index], dtype=torch.int64, device=group.device)
        group.all_reduce(ids, op="max", label=f"unit check before {u.label}").wait()
        if int(ids[0]) != u.index or int(-ids[1]) != u.index:
            others = sorted({int(ids[0]), int(-ids[1])} - {u.index})
            # Another rank may hold more units than this one (an extra layer): name it by index.
            names = ", ".join(
                self.units[i].label if 0 <= i < len(self.units) else f"unit {i}" for i in others
            )
            raise DivergentRanksError(
                f"rank {group.rank} is gathering {u.label} while another rank is "
                f"gathering {names}: the ranks ran different modules (a skipped or extra module?)"
            )

    def verify_order(self) -> None:
        """Compare this step's gather order across ranks (one collective); reset it."""
        sequence, digest = list(self._sequence), self._hash
        self._sequence.clear()
        self._hash = 0
        group = self._shard_group
        if self._check_each or group.size == 1:
            return
        t = torch.tensor([digest, -digest], dtype=torch.int64, device=group.device)
        group.all_reduce(t, op="max", label="unit order check").wait()
        if int(t[0]) != digest or int(-t[1]) != digest:
            raise DivergentRanksError(
                f"ranks gathered different units this step; rank {group.rank} gathered "
                "(last 64): " + ", ".join(sequence)
            )

    # -- StepHooks -----------------------------------------------------------------------
    def before_step(self) -> None:
        """Before the optimizer step: every rank gathered the same units."""
        self.verify_order()

    def after_publish(self) -> None:
        """After new shards were published: drop every gathered unit (its values changed)."""
        self.release_all()

    def release_all(self) -> None:
        """Drop every gathered unit."""
        for u in self.units:
            u.release()

    # -- BackwardEvents ------------------------------------------------------------------
    def reduce_order(self) -> Sequence[FlatParamGroup]:
        """The flat groups in the order backward completes them: the reverse of the last
        recorded forward order, then units not seen there (the same object until the
        order changes)."""
        return self._reduce_order

    def grads_ready(self, g: FlatParamGroup) -> None:
        """All of `g`'s gradients are in its bucket: tell its unit."""
        self._unit_of_group[g.index].grads_reduced(g)

    def backward_done(self) -> None:
        """End of backward: every unit releases what it still holds."""
        for u in self.units:
            u.backward_done()

    def _launch_order(self, order: Sequence[Unit]) -> list[FlatParamGroup]:
        seen: dict[int, FlatParamGroup] = {}
        for u in [*reversed(order), *reversed(self.units)]:
            for g in u.groups:
                seen.setdefault(g.index, g)
        return list(seen.values())

    # -- prefetch ------------------------------------------------------------------------
    def _prefetch(self, candidates: Sequence[Unit]) -> None:
        """Start gathering the released ones of `candidates` the budget takes, in order."""
        released = [u for u in candidates if u.state is UnitState.RELEASED]
        taken = self.prefetch.take([u.nbytes for u in released], self.stats.live_bytes)
        for u in released[:taken]:
            u.start_gather(prefetch=True)

    # -- forward -------------------------------------------------------------------------
    def _make_pre_forward(self, u: Unit) -> Any:
        def pre_forward(module: nn.Module, args: Any) -> None:
            if self._suspended:
                return
            if _in_backward():
                u.gather()  # recomputation under activation checkpointing
                return
            self._record(u)
            u.pre_forward()
            if self._order_valid:
                pos = len(self._recording) - 1
                self._prefetch(self._order[pos + 1 : pos + 1 + self.prefetch.depth])

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
            if self._suspended or _in_backward():
                return
            backward_may_follow = False
            if torch.is_grad_enabled():
                for t in tree_flatten(output)[0]:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(self._make_pre_backward(u))  # type: ignore[no-untyped-call]
                        backward_may_follow = True
            if u.index == 0:
                self._end_of_forward()
            u.post_forward(keep=backward_may_follow and self._last_of_forward(u))

        return post_forward

    def _last_of_forward(self, u: Unit) -> bool:
        """Whether `u` is the last unit of a forward that ran in the recorded order: the
        first that backward gathers again (after the root, which stays gathered)."""
        order = self._order
        return self._order_valid and len(self._recording) == len(order) and order[-1] is u

    def _end_of_forward(self) -> None:
        # The root's forward wraps all others: the order recorded this step is complete.
        if not self._order_valid and self._recording:
            self._order = self._recording
            # A unit run twice keeps its last forward position (its first in backward).
            self._position = {u.index: i for i, u in enumerate(self._order)}
            self._order_valid = True
            self._reduce_order = self._launch_order(self._order)
        self._recording = []

    # -- backward ------------------------------------------------------------------------
    def _make_pre_backward(self, u: Unit) -> Any:
        def pre_backward(grad: torch.Tensor) -> torch.Tensor:
            u.pre_backward()
            pos = self._position.get(u.index) if self._order_valid else None
            if pos:
                self._prefetch(self._order[max(0, pos - self.prefetch.depth) : pos][::-1])
            return grad

        return pre_backward
