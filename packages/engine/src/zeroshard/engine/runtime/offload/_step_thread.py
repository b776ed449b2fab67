"""`StepThread`: the thread that steps offloaded groups beside the main thread.

Under `step_in_backward` it steps each group as its gradient lands ([Note: offload step
pipeline] in _step.py); under `delay_param_update` it steps one window's groups
while the next window computes ([Note: delayed parameter update] there). Meanwhile the
main thread's OpenMP team is cut and the stepping thread takes the other cores ([Note:
host step threads] in _threads.py).
"""

from __future__ import annotations

import functools
import itertools
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime.offload._io import grad_worker
from zeroshard.engine.runtime.offload._threads import cut_team, stepping_threads


class StepThread:
    """The stepping thread (made on first use) and the steps it has outstanding."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._thread: ThreadPoolExecutor | None = None
        # The main thread's intra-op threads while its team is cut.
        self._main_threads: int | None = None
        # step_in_backward: the step of each group stepped as its gradient lands, by index.
        self._step_now: Mapping[int, Callable[[], None]] = {}
        # Called here with each group so stepped just before its step reads the gradient
        # (the gradient journal's record: [Note: the gradient journal] in recovery/_journal.py).
        self.before_each: Callable[[FlatParamGroup], None] | None = None
        self._steps: deque[Future[None]] = deque()
        # delay_param_update: the step of each group in flight, and what runs after them.
        self._delayed: dict[int, Future[None]] = {}
        self._delayed_tail: Future[None] | None = None
        # Each group's place in the order gradients arrived (the latest arrival counts):
        # the order a delayed step steps them in.
        self._arrival: dict[int, int] = {}
        self._arrivals = itertools.count()

    def arrived(self, g: FlatParamGroup) -> None:
        """A gradient of `g` arrives: note its place, and wait until the delayed step in
        flight is done with `g`'s host gradient, which it still reads."""
        self._arrival[g.index] = next(self._arrivals)
        step = self._delayed.pop(g.index, None)
        if step is not None:
            step.result()

    def steps_now(self, g: FlatParamGroup) -> bool:
        """Whether `g` is stepped as its gradient lands (`step_each`)."""
        return g.index in self._step_now

    def landing(self, g: FlatParamGroup, copy: Future[None]) -> Future[None] | None:
        """Under `step_each`: step `g` on this thread once `copy` (its gradient's copy and
        add) completed, if it is one of the groups stepped so; that step, or None. Not on
        the copying worker: a receive waiting for its oldest copy to retire would wait
        behind the CPU steps queued before it, so backward would stall on the optimizer."""
        step_one = self._step_now.get(g.index)
        if step_one is None:
            return None
        before = None if self.before_each is None else functools.partial(self.before_each, g)
        step = self._executor().submit(_after, copy, step_one, before)
        self._steps.append(step)
        return step

    def step_each(self, steps: Mapping[int, Callable[[], None]] | None) -> None:
        """From now on step each group of `steps` (its step by index) on the stepping
        thread as its gradient lands (None: stop)."""
        if steps is not None:
            self._take_cores()
        else:
            self._give_cores_back()
        self._step_now = steps or {}

    def step_delayed(
        self,
        groups: Sequence[FlatParamGroup],
        step_one: Callable[[FlatParamGroup], None],
        then: Callable[[], None],
    ) -> None:
        """delay_param_update: step `groups` one after another on the stepping thread, in
        the order their gradients arrived, then run `then`, and return at once. A group's
        next gradient waits in `arrived` for its step; `settle` waits for all of it."""
        assert not self._delayed and self._delayed_tail is None
        self._take_cores()
        executor = self._executor()
        # The next backward's gradients come in the last one's order, each waiting for its
        # group's step: stepped in another order, the first waits for most of the step
        # (groups with no gradient, stepped at no cost, go first).
        for g in sorted(groups, key=lambda g: self._arrival.get(g.index, -1)):
            self._delayed[g.index] = executor.submit(step_one, g)
        self._delayed_tail = executor.submit(then)

    def settle(self) -> None:
        """Wait for the delayed step in flight, if any (raising what it raised)."""
        futures = [*self._delayed.values(), *([self._delayed_tail] if self._delayed_tail else [])]
        self._delayed.clear()
        self._delayed_tail = None
        for f in futures:
            # Every one is waited, so none is still running when the first error raises.
            f.exception()
        self._give_cores_back()
        for f in futures:
            f.result()

    def drain(self) -> None:
        """Wait until every group stepped as its gradient landed was stepped."""
        while self._steps:
            self._steps.popleft().result()

    def _executor(self) -> ThreadPoolExecutor:
        """The stepping thread (made on first use, with the cores `_take_cores` freed)."""
        if self._thread is None:
            threads = None
            if self._main_threads is not None:
                threads = stepping_threads(self._main_threads)
            self._thread = grad_worker(self.device, "zeroshard-offload-step", threads=threads)
        return self._thread

    def _take_cores(self) -> None:
        """Cut the main thread's OpenMP team while the stepping thread steps; on the CPU
        the backward needs them."""
        if self._main_threads is None and self.device.type == "cuda":
            self._main_threads = cut_team()

    def _give_cores_back(self) -> None:
        if self._main_threads is not None:
            torch.set_num_threads(self._main_threads)
            self._main_threads = None


def _after(
    landed: Future[None], step_one: Callable[[], None], before: Callable[[], None] | None
) -> None:
    """On the stepping thread: step a group once its gradient landed (and was added)."""
    landed.result()
    if before is not None:
        before()
    step_one()
