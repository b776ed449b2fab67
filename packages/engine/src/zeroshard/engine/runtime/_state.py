"""`EngineState`: what `initialize` attaches to a model, and how the other modules find it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeAlias, runtime_checkable

from torch import nn

from zeroshard.comm import Group
from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._home import HomeKind, HomeStore
from zeroshard.engine.runtime._optimizer import ZeroOptimizer, publish_masters
from zeroshard.engine.runtime._stage3 import Stage3Runtime
from zeroshard.engine.runtime._stats import EngineStats
from zeroshard.engine.runtime._stepper import WholeParams
from zeroshard.engine.runtime._tensor_parallel import TensorParallel, own_path

_ATTR = "_zeroshard_engine"

NO_OPTIMIZER = (
    "needs the optimizer, and this model was initialized without one "
    "(zeroshard.engine.initialize(model, None, config): evaluation only); initialize it "
    "with its optimizer to train, save a checkpoint or read optimizer state"
)
"""What a call that needs the optimizer says on an evaluation-only engine, after its name."""


@dataclass(frozen=True)
class EngineState:
    """What `initialize` attached to a model: its config, flat groups and optimizer.

    `shard_group` is the process group the flat groups are sharded over (the world, or
    under hybrid sharding one shard group); `replicate` averages across shard groups.
    With a device mesh (`tensor_parallel`) the flat groups are sharded over its dp dim
    and `shard_group` is every rank of the job, as with groups on process groups of
    their own (each tensor-parallel rank's pieces are one instance of them).
    `whole_params`: what whole-matrix optimizers that keep their state per parameter
    step whole (`whole/_whole_step.py`); None where no optimizer does. `optimizer` is None
    for a model initialized without one, for evaluation (`needs_optimizer`).
    """

    config: ZeroConfig
    shard_group: Group
    replicate: Group | None
    groups: tuple[FlatParamGroup, ...]
    optimizer: ZeroOptimizer | None
    stage3: Stage3Runtime | None
    tensor_parallel: TensorParallel | None = None
    whole_params: WholeParams | None = None

    def needs_optimizer(self, call: str) -> ZeroOptimizer:
        """The optimizer, or a ValueError naming `call` where there is none (the same on
        every rank: whether there is one is agreed at initialize)."""
        if self.optimizer is None:
            raise ValueError(f"{call} {NO_OPTIMIZER}")
        return self.optimizer

    def settle(self) -> None:
        """Wait for the optimizer's step in flight, if any (`ZeroOptimizer.settle`)."""
        if self.optimizer is not None:
            self.optimizer.settle()

    def republish(self) -> None:
        """Make every master what forward computes with, after it changed in place (a
        load): `ZeroOptimizer.republish`, which an evaluation-only engine does itself."""
        if self.optimizer is not None:
            self.optimizer.republish()
            return
        publish_masters(self.groups, self.config.comm.allgather_bucket_bytes)
        if self.stage3 is not None:
            self.stage3.release_all()

    def replicated(self, g: FlatParamGroup) -> bool:
        """Whether `g`'s shards are the same on every replica (hybrid sharding), its
        reduced gradients then averaged over `replicate`: every group but those on
        process groups of their own."""
        return self.replicate is not None and own_path(g.key.process_group) is None

    @property
    def own_crosses_replicas(self) -> bool:
        """Whether groups on process groups of their own sit beside replicas (hybrid
        sharding), which they may cross: every rank then writes checkpoints ([Note: groups
        of their own beside hybrid sharding and tensor parallelism] in setup/_placement.py)."""
        return self.replicate is not None and any(
            own_path(g.key.process_group) is not None for g in self.groups
        )

    @property
    def offload(self) -> HomeStore | None:
        """CPU offload's host storage (the store of the groups homed on the host), None
        where no group is."""
        return next((g.home.store for g in self.groups if g.home.kind is HomeKind.HOST), None)


@runtime_checkable
class WrapsEngineModel(Protocol):
    """A wrapper the engine's functions accept in place of the model it wraps, as torch's
    accept a `torch.compile`d module (`zeroshard.compile.CompiledModel`)."""

    @property
    def zeroshard_module(self) -> nn.Module:
        """The initialized model inside the wrapper."""
        ...


# What the engine's public functions take: the initialized model or a wrapper of it.
EngineModel: TypeAlias = nn.Module | WrapsEngineModel


def engine_module(model: EngineModel) -> nn.Module:
    """`model` itself, or the module inside a wrapper (the engine imports no wrapper: the
    `zeroshard_module` attribute is the seam; see `WrapsEngineModel`)."""
    inner = getattr(model, "zeroshard_module", None)
    if isinstance(inner, (nn.Module, WrapsEngineModel)):
        return engine_module(inner)
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"expected a model initialized with zeroshard.engine.initialize() (or its "
            f"zeroshard.compile.CompiledModel), got a {type(model).__name__}"
        )
    return model


def is_initialized(model: nn.Module) -> bool:
    """Whether `initialize` already attached an engine to `model`."""
    return hasattr(model, _ATTR)


def attach_state(model: nn.Module, state: EngineState) -> None:
    """Attach `state` to `model` (once, at the end of `initialize`)."""
    setattr(model, _ATTR, state)


def engine_state(model: EngineModel) -> EngineState:
    """The engine state `initialize` attached to `model` (or to the model it wraps)."""
    state = getattr(engine_module(model), _ATTR, None)
    if not isinstance(state, EngineState):
        raise ValueError("this model was not initialized with zeroshard.engine.initialize()")
    return state


def engine_stats(model: EngineModel) -> EngineStats:
    """Stage 3 counters (gathers, bytes gathered, live and peak gathered bytes, ...)."""
    runtime = engine_state(model).stage3
    if runtime is None:
        raise ValueError("engine statistics are kept for stage 3 only (stages 1/2 gather nothing)")
    return runtime.stats
