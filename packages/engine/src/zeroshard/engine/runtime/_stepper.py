"""`Stepper`: how the master shards are stepped. `ZeroOptimizer` holds one, chosen by
`initialize` from the config, and never asks which it is.

The optimizer prepares the gradients (reduced, fp16-unscaled, clipped) and publishes the
masters; what happens between is the stepper's: `DeviceStep` here (the wrapped optimizer
on the device, in one call), the host steps of CPU offload in `offload/_steppers.py`
(serial, in backward, delayed), the whole-matrix steps in `whole/` (Muon's, and any
optimizer's on whole parameters), and `StepEach` for several optimizers at once. A
stepper holds the flat groups and the wrapped optimizer
it steps them with, so it may step some groups one way and others another, and run
collectives over a group's `process_group` inside its step; `step()` says whether the
masters are final (publish now) or still stepping (published at the next `step()`; till
then the optimizer's parameters lag the masters: `ZeroOptimizer.lagging`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import torch
from torch import nn


class StepOutcome(Enum):
    """What a stepper's `step()` leaves: masters to publish now, or a step still running."""

    PUBLISH = "publish"  # the masters are this step's: publish them now
    DEFERRED = "deferred"  # published at the next step(), once `settle` waited for it


@dataclass(frozen=True)
class WholeParams:
    """What the steppers of whole-matrix optimizers that keep their state per parameter
    step whole (`whole/_whole_step.py`), for checkpoints to keep that state by name: every
    such parameter's name (the same on every rank), this rank's own whole parameters, and
    those of them whose state lives on the host between steps (offloaded: [Note: whole
    parameters offloaded])."""

    names: frozenset[str]
    owned: Mapping[str, nn.Parameter]
    on_host: frozenset[str] = frozenset()


class Stepper(Protocol):
    """How the trainable master shards are stepped on their gradients."""

    def step(self) -> StepOutcome:
        """Step every trainable master on its gradient (reduced, unscaled, clipped)."""
        ...

    def settle(self) -> None:
        """Wait for a step still running, raising what it raised: the masters and the
        optimizer state are then those of every `step()` so far."""
        ...

    def step_in_backward(self, *, stage: int, loss_scaled: bool) -> AbstractContextManager[None]:
        """The backward inside steps groups as their gradients land (`ZeroOptimizer.
        step_in_backward`); a ValueError naming why where this stepper cannot."""
        ...

    def clip_refusal(self) -> str:
        """Why clipping now would be wrong ('' where it is not)."""
        ...


def step_in_backward_refusal(
    *, offloaded: bool, stage: int, loss_scaled: bool, delayed: bool
) -> str:
    """Why `ZeroOptimizer.step_in_backward()` refuses a run so configured ('' where it
    does not); the planner asks it too."""
    if not offloaded:
        return "it needs offload_optimizer"
    if stage == 1:
        return "stage 1 reduces the gradients at the step, after backward"
    if loss_scaled:
        return "fp16 loss scaling checks every gradient for overflow first"
    if delayed:
        return "offload.delay_param_update already overlaps the step with the next backward"
    return ""


class OnDevice:
    """What the steppers that step on the device after backward share: nothing runs after
    `step()`, so nothing is deferred or settled, and no step in backward."""

    def settle(self) -> None:
        """Nothing runs after `step()` returned."""

    def step_in_backward(self, *, stage: int, loss_scaled: bool) -> AbstractContextManager[None]:
        """Refused: the device step has nothing to overlap with backward."""
        why = step_in_backward_refusal(
            offloaded=False, stage=stage, loss_scaled=loss_scaled, delayed=False
        )
        raise ValueError(f"step_in_backward(): {why}")

    def clip_refusal(self) -> str:
        """Clipping is always right before the step."""
        return ""


class AfterBackward(OnDevice):
    """A stepper whose groups step at `step()` only, even under `step_in_backward`: beside
    steppers that step in backward (`StepEach`) it waits for `step()`; alone it refuses,
    saying `why` (a whole-matrix step: [Note: whole-matrix steps are collectives] in
    whole/_exchange.py)."""

    why = ""

    def step_in_backward(self, *, stage: int, loss_scaled: bool) -> AbstractContextManager[None]:
        """Refused: nothing would step in backward."""
        raise ValueError(f"step_in_backward(): {self.why}")


class DeviceStep(OnDevice):
    """Every master on the device, stepped by the wrapped optimizer in one call."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner

    def step(self) -> StepOutcome:
        """One step of the wrapped optimizer; the masters are final."""
        self.inner.step()
        return StepOutcome.PUBLISH


class StepEach:
    """Several steppers over disjoint flat groups (one per optimizer of a combined one),
    stepped in turn."""

    def __init__(self, steppers: Sequence[Stepper]) -> None:
        self.steppers = list(steppers)

    def step(self) -> StepOutcome:
        """Each in turn; the masters are final once every one's are."""
        outcomes = [s.step() for s in self.steppers]
        return (
            StepOutcome.PUBLISH
            if all(o is StepOutcome.PUBLISH for o in outcomes)
            else StepOutcome.DEFERRED
        )

    def settle(self) -> None:
        """Wait for each."""
        for s in self.steppers:
            s.settle()

    @contextlib.contextmanager
    def step_in_backward(self, *, stage: int, loss_scaled: bool) -> Iterator[None]:
        """Each one's, the backward inside all of them (the first refusal raises); those
        that step after backward only (`AfterBackward`) wait for `step()`, unless no other
        is there to step in backward."""
        inside = [s for s in self.steppers if not isinstance(s, AfterBackward)]
        with contextlib.ExitStack() as stack:
            for s in inside or self.steppers:
                stack.enter_context(s.step_in_backward(stage=stage, loss_scaled=loss_scaled))
            yield

    def clip_refusal(self) -> str:
        """The first refusal of any."""
        return next((why for s in self.steppers if (why := s.clip_refusal())), "")
