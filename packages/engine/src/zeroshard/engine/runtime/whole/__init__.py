"""Whole-matrix optimizers (torch.optim.Muon, or any that declares it needs a parameter's
full shape): which rank owns each matrix, how its pieces reach the owner and come back,
and the steppers. The rest of the engine reaches it through this face only; it reaches
the core through the `Stepper` seam."""

from zeroshard.engine.runtime.whole._build import (
    WholeMatrices,
    owned_host_state,
    whole_param_groups,
)
from zeroshard.engine.runtime.whole._declare import split_muon, steps_whole, torch_muon
from zeroshard.engine.runtime.whole._exchange import WHOLE_STEP_IS_COLLECTIVE
from zeroshard.engine.runtime.whole._owners import MatrixOwners, plan_owners
from zeroshard.engine.runtime.whole._whole_step import host_state

__all__ = [
    "WHOLE_STEP_IS_COLLECTIVE",
    "MatrixOwners",
    "WholeMatrices",
    "host_state",
    "owned_host_state",
    "plan_owners",
    "split_muon",
    "steps_whole",
    "torch_muon",
    "whole_param_groups",
]
