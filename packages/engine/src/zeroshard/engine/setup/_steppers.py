"""The stepper of each optimizer `initialize` was given, over its own flat groups: a
whole-matrix optimizer's (`runtime.whole`), a host step where CPU offload holds some of
its groups (`runtime.offload`: one host stepper for all such optimizers), else the device
step; several are stepped in turn."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._stepper import DeviceStep, StepEach, Stepper, WholeParams
from zeroshard.engine.runtime._tensor_parallel import TensorParallel
from zeroshard.engine.runtime.offload import HostOffload, host_stepper
from zeroshard.engine.runtime.whole import WholeMatrices, steps_whole


def build_steppers(
    optimizers: Sequence[torch.optim.Optimizer],
    groups: Sequence[FlatParamGroup],
    host: HostOffload | None,
    cfg: ZeroConfig,
    tensor_parallel: TensorParallel | None,
) -> tuple[Stepper, WholeParams | None]:
    """One stepper per optimizer over the flat groups of its param groups (several stepped
    in turn), and what whole-matrix optimizers step whole by name (None: none); matrices
    split over `tensor_parallel` are brought together for theirs."""
    whole = None
    if any(map(steps_whole, optimizers)):
        whole = WholeMatrices(optimizers, groups, tensor_parallel)
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
    stepper = parts[0] if len(parts) == 1 else StepEach(parts)
    return stepper, None if whole is None else whole.params
