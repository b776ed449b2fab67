"""The `Stepper`s of CPU offload: the host step after backward, or in it (`HostStep`), and
the step beside the next window (`DelayedHostStep`). Each steps the trainable groups of
every optimizer CPU offload steps, those the `HostOffload` holds on the host and the
others on the device, each group with the optimizer that owns it ([Note: offload step
pipeline] and [Note: delayed parameter update] in _step.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager

import torch

from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._stepper import StepOutcome, step_in_backward_refusal
from zeroshard.engine.runtime.offload._host_offload import HostOffload
from zeroshard.engine.runtime.offload._step import DelayedStep, EarlyStep, Owned, step_offloaded


class _HostSteps:
    """What both host steppers hold: the host state, and each optimizer (one or several)
    with its trainable groups on the device and on the host."""

    def __init__(
        self,
        optimizers: Sequence[tuple[torch.optim.Optimizer, Sequence[FlatParamGroup]]],
        offload: HostOffload,
    ) -> None:
        self.offload = offload
        self.owned: list[Owned] = []
        for inner, groups in optimizers:
            trainable = [g for g in groups if g.trainable]
            on_device = [g for g in trainable if not offload.holds(g)]
            on_host = [g for g in trainable if offload.holds(g)]
            self.owned.append(Owned(inner, on_device, on_host))
            # The blocked step keeps views of the state: drop them before a load replaces
            # it, or they would keep the old state's memory ([Note: blocked step loop]).
            inner.register_load_state_dict_pre_hook(lambda *_: offload.forget_state())


class HostStep(_HostSteps):
    """The offloaded groups stepped on the host one at a time after backward, uploading as
    it goes; under `step_in_backward()` each as its gradient lands instead."""

    def __init__(
        self,
        optimizers: Sequence[tuple[torch.optim.Optimizer, Sequence[FlatParamGroup]]],
        offload: HostOffload,
    ) -> None:
        super().__init__(optimizers, offload)
        # The step of a backward under step_in_backward(), finished by the next step().
        self._early: EarlyStep | None = None

    def step(self) -> StepOutcome:
        """Step every trainable master (the rest of an early step's), then publish."""
        if self._early is not None:
            self._early.finish()
            self._early = None
        else:
            for o in self.owned:
                step_offloaded(o.inner, self.offload, o.on_device, o.on_host)
        return StepOutcome.PUBLISH

    def settle(self) -> None:
        """Nothing runs after `step()` returned; what writes the masters next waits for
        the gathers reading them ([Note: masters read by gathers] in _upload.py)."""
        self.offload.settle_reads()

    @contextlib.contextmanager
    def step_in_backward(self, *, stage: int, loss_scaled: bool) -> Iterator[None]:
        """Step each offloaded group as its gradient lands while the block's backward goes
        on ([Note: offload step pipeline])."""
        why = step_in_backward_refusal(
            offloaded=True, stage=stage, loss_scaled=loss_scaled, delayed=False
        )
        if not why and self._early is not None:
            why = "the step of the previous backward under it has not run: call step()"
        if why:
            raise ValueError(f"step_in_backward(): {why}")
        self._early = EarlyStep(self.owned, self.offload)
        try:
            yield
        except BaseException:
            # A failed backward: stop stepping groups as they land; `step()` is not coming.
            self.offload.step_thread.step_each(None)
            self._early = None
            raise

    def clip_refusal(self) -> str:
        """After a backward under step_in_backward(): its groups were stepped already."""
        if self._early is None:
            return ""
        return (
            "clip_grad_norm_ after a backward under step_in_backward(): the offloaded "
            "groups were stepped on their unclipped gradients; clip without it"
        )


class DelayedHostStep(_HostSteps):
    """offload.delay_param_update: `step()` k steps the device groups, hands the offloaded
    ones to the stepping thread and returns; step() k+1 waits for it and publishes its
    masters first ([Note: delayed parameter update])."""

    def __init__(
        self,
        optimizers: Sequence[tuple[torch.optim.Optimizer, Sequence[FlatParamGroup]]],
        offload: HostOffload,
    ) -> None:
        super().__init__(optimizers, offload)
        # The step in flight.
        self._delayed: DelayedStep | None = None

    def step(self) -> StepOutcome:
        """Start the host step on the stepping thread; its masters are published later."""
        self._delayed = DelayedStep(self.owned, self.offload)
        return StepOutcome.DEFERRED

    def settle(self) -> None:
        """Wait for the step in flight, raising what it raised."""
        if self._delayed is not None:
            delayed, self._delayed = self._delayed, None
            delayed.wait()

    def step_in_backward(self, *, stage: int, loss_scaled: bool) -> AbstractContextManager[None]:
        """Refused: the delayed step overlaps the next backward already."""
        why = step_in_backward_refusal(
            offloaded=True, stage=stage, loss_scaled=loss_scaled, delayed=True
        )
        raise ValueError(f"step_in_backward(): {why}")

    def clip_refusal(self) -> str:
        """Clipping waits for the step in flight (`settle`) and is then right."""
        return ""
