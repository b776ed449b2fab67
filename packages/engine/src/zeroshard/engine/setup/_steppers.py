"""The stepper of each optimizer `initialize` was given, over its own flat groups: a
whole-matrix optimizer's (`runtime.whole`), a host step where CPU offload holds some of
its groups (`runtime.offload`: one host stepper for all such optimizers), else the device
step; several are stepped in turn."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._stepper import DeviceStep, StepEach, Stepper
from zeroshard.engine.runtime.offload import HostOffload, host_stepper
from zeroshard.engine.runtime.whole import WholeMatrices, steps_whole


def build_steppers(
    optimizers: Sequence[torch.optim.Optimizer],
    groups: Sequence[FlatParamGroup],
    host: HostOffload | None,
    cfg: ZeroConfig,
    whole: WholeMatrices | None,
) -> Stepper:
    """One stepper per optimizer over the flat groups of its param groups (several stepped
    in turn), on param groups already bound (`bind_masters`); `whole`: the whole-matrix
    optimizers' owners, exchanges and whole parameters (None: there are none)."""
    parts: list[Stepper] = []
    # The optimizers CPU offload steps, each with its own groups: one host stepper, whose
    # schedules (in backward, delayed) step each landing group with its own optimizer.
    hosted: list[tuple[torch.optim.Optimizer, list[FlatParamGroup]]] = []
    offset = 0
    for o in optimizers:
        ks = range(offset, offset + len(o.param_groups))
        mine = [g for g in groups if g.key.param_group in ks]
        if whole is not None and steps_whole(o):
            parts.append(whole.stepper(o, mine, offset))
        elif host is not None:
            hosted.append((o, mine))
        else:
            parts.append(DeviceStep(o))
        offset += len(o.param_groups)
    if host is not None and hosted:
        # Last: a whole-matrix step refreshes its offloaded homes in an upload round of its
        # own, which must close before a delayed step opens the host stepper's.
        parts.append(host_stepper(hosted, host, cfg))
    return parts[0] if len(parts) == 1 else StepEach(parts)
