"""CPU offload: the masters, gradients and optimizer state of flat groups on the host (their
homes: [Note: home and wire] in runtime/_home.py), and the host steps of those masters
(serial, in backward, delayed). The rest of the engine reaches it through this face only;
it reaches the core through the interfaces the core defines."""

from zeroshard.engine.runtime.offload._build import (
    build_host_storage,
    check_offload,
    compile_host_step,
    host_stepper,
    plan_offload,
)
from zeroshard.engine.runtime.offload._fused_adam import steps_in_blocks
from zeroshard.engine.runtime.offload._host_offload import HostOffload, OffloadBytes
from zeroshard.engine.runtime.offload._plan import OffloadSizes, place_offloaded
from zeroshard.engine.runtime.offload._step_thread import StepThread

__all__ = [
    "HostOffload",
    "OffloadBytes",
    "OffloadSizes",
    "StepThread",
    "build_host_storage",
    "check_offload",
    "compile_host_step",
    "host_stepper",
    "place_offloaded",
    "plan_offload",
    "steps_in_blocks",
]
