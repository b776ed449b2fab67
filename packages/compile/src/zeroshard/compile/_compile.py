"""`compile(model)`: a zeroshard stage-3 model as one compiled graph, or eager with a warning."""

from __future__ import annotations

import gc
import logging
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from zeroshard.comm import warn_on_rank0
from zeroshard.compile._backend import Captures, capture_errors, make_backend
from zeroshard.compile._capture import (
    flat_specs,
    gathered_forward,
    graph_scales,
    graph_shards,
    route_grads,
)
from zeroshard.compile._host import grad_sinks, route_host_grads
from zeroshard.compile._ops import unregister_target
from zeroshard.compile._passes import default_pipeline
from zeroshard.compile._pipeline import Pipeline
from zeroshard.engine import EngineState, EngineStats, engine_state

log = logging.getLogger("zeroshard.compile")

# Gathers this small cost more in launch latency than in bytes: fuse adjacent ones.
DEFAULT_FUSE_BYTES = 2**20


class CompiledModel:
    """Call it like the model: runs the compiled graph (or the eager model after a fallback).

    It stands for the model everywhere: the engine's functions (`full_state_dict`,
    `save_checkpoint`, ...) take it through `zeroshard_module`, and `state_dict()`,
    `parameters()`, `train()`, ... are the wrapped module's. `stats` (the engine's
    `EngineStats`) counts the compiled gathers and reduce-scatters; `compiles` counts
    captures (Dynamo recompilations); `eager` is True once it fell back to the eager model.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        pipeline: Pipeline,
        prefetch_bytes: int,
        persist_bytes: int,
        fuse_bytes: int,
        torch_compile_kwargs: dict[str, Any],
    ) -> None:
        self.module = model
        self.stats = EngineStats()
        self._captures = Captures()
        self.eager = False
        state = engine_state(model)
        self._state = state
        self._scales = graph_scales(state)
        self._sinks = grad_sinks(state)
        kwargs = dict(torch_compile_kwargs)
        inner = kwargs.pop("backend", "inductor")
        options = kwargs.pop("options", None)
        fullgraph = kwargs.pop("fullgraph", True)
        self._specs = flat_specs(state, self.stats)
        self._grad_hooks = route_grads(state) + route_host_grads(state, self._sinks)

        backend = make_backend(
            pipeline,
            inner,
            prefetch_bytes=prefetch_bytes,
            persist_bytes=persist_bytes,
            fuse_bytes=fuse_bytes,
            options=options,
            captures=self._captures,
        )
        self._compiled = torch.compile(
            gathered_forward(model, state, self._specs),
            backend=backend,
            fullgraph=fullgraph,
            **kwargs,
        )

    @property
    def zeroshard_module(self) -> nn.Module:
        """The initialized model (`zeroshard.engine.WrapsEngineModel`): what the engine's
        functions work on when given this wrapper."""
        return self.module

    # The module's own API, as on a torch.compile'd module: the graph reads the same
    # parameters, so these need no compiled counterpart.
    @property
    def training(self) -> bool:
        """Whether the wrapped module is in training mode."""
        return self.module.training

    def train(self, mode: bool = True) -> CompiledModel:
        """Set the wrapped module's training mode (the graph is recaptured for a new mode)."""
        self.module.train(mode)
        return self

    def eval(self) -> CompiledModel:
        """The wrapped module in evaluation mode."""
        return self.train(False)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped module's `state_dict()` (full tensors at stage 3, as the engine's)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        """The wrapped module's `load_state_dict()` (full tensors, as the engine's takes)."""
        return self.module.load_state_dict(state_dict, strict)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The wrapped module's parameters."""
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """The wrapped module's named parameters."""
        return self.module.named_parameters(*args, **kwargs)

    @property
    def compiles(self) -> int:
        """How many graphs Dynamo captured (recompilations included; it should stay 1)."""
        return self._captures.count

    def _fall_back(self, reason: str) -> None:
        self.eager = True
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks = []
        # Once: every later call goes straight to the eager model.
        # Every rank falls back alike (the same model code): rank 0 says so.
        warn_on_rank0(
            f"zeroshard.compile: cannot capture this model ({reason}); "
            "running the eager zeroshard model instead",
            RuntimeWarning,
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Forward through the compiled graph (capturing it on first call)."""
        if self.eager:
            return self.module(*args, **kwargs)
        runtime = self._state.stage3
        assert runtime is not None
        first = self.compiles == 0
        try:
            # The compiled graph gathers and releases itself: the engine's hooks stand aside.
            with runtime.suspended():
                shards = graph_shards(self._state)
                return self._compiled(shards, self._scales, self._sinks, args, kwargs)
        except capture_errors() as e:
            if not first:
                raise
            # Dynamo fails before the graph runs, on every rank alike (the model code is
            # the same), so no rank has issued a collective the others will not.
            self._fall_back(_reason(e))
            log.debug("zeroshard.compile: capture failed", exc_info=e)
        # Dynamo's failed trace is cyclic garbage that holds the model through references
        # the cycle collector does not traverse: a gc.collect() after the user drops the
        # model would free the trace but leave the model for the next one. Collected
        # here, once, the trace no longer keeps a dropped model alive.
        gc.collect()
        return self.module(*args, **kwargs)

    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        # A model still alive at interpreter exit is finalized after the modules were
        # cleared (their globals None: `unregister_target` would raise, printed as an
        # ignored exception); the registry goes with the process then. The check is
        # bound here, as a default, because this module's `sys` may be None by then too.
        if _finalizing():
            return
        for spec in getattr(self, "_specs", []):
            unregister_target(spec.key)


def _reason(e: BaseException) -> str:
    """The error a capture failed with, in one line."""
    # A failing backend or pass is wrapped by Dynamo: name the error inside.
    cause = getattr(e, "inner_exception", None) or e.__cause__ or e
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}"


def default_persist_bytes(state: EngineState) -> int:
    """The engine's `persistence_threshold` (elements per unit) as compile's budget (bytes
    in all): the gathered bytes of the units the eager engine keeps gathered from forward
    into backward because they are small (the root, kept for the order of its hooks, not
    for its size, is left out)."""
    assert state.stage3 is not None
    return sum(u.nbytes for u in state.stage3.units[1:] if u.persistent)


def compile(
    model: nn.Module,
    *,
    pipeline: Pipeline | None = None,
    prefetch_bytes: int | None = None,
    persist_bytes: int | None = None,
    fuse_bytes: int = DEFAULT_FUSE_BYTES,
    **torch_compile_kwargs: Any,
) -> CompiledModel:
    """Compile a zeroshard stage-3 model (from `zeroshard.engine.initialize`) into one graph.

    Budgets are bytes. `prefetch_bytes` defaults to the engine's `prefetch_bytes`;
    `persist_bytes` (gathered bytes kept from forward into backward) to
    `default_persist_bytes`, the engine's `persistence_threshold` converted to bytes.
    `torch_compile_kwargs` go to `torch.compile`; `backend` is "inductor" (default) or
    "aot_eager"; `options` are inductor config patches; `fullgraph` defaults to True.
    """
    state = engine_state(model)
    if state.config.stage != 3 or state.stage3 is None:
        raise ValueError(
            f"zeroshard.compile needs a stage-3 model; this one is stage {state.config.stage}"
        )
    if state.config.offload.params:
        raise ValueError(
            "zeroshard.compile with offload_params: the compiled graph takes every group's "
            "shard as an input at its start, so every compute shard would be on the device "
            "at once, which offload_params exists to avoid; compile with offload_optimizer "
            "alone, or run offload_params eagerly (each shard goes up just before its gather)"
        )
    if prefetch_bytes is None:
        prefetch_bytes = state.config.stage3.prefetch_bytes
    if persist_bytes is None:
        persist_bytes = default_persist_bytes(state)
    if min(prefetch_bytes, persist_bytes, fuse_bytes) < 0:
        raise ValueError(
            f"budgets must be >= 0 bytes, got prefetch_bytes={prefetch_bytes}, "
            f"persist_bytes={persist_bytes}, fuse_bytes={fuse_bytes}"
        )
    return CompiledModel(
        model,
        pipeline=pipeline or default_pipeline(),
        prefetch_bytes=prefetch_bytes,
        persist_bytes=persist_bytes,
        fuse_bytes=fuse_bytes,
        torch_compile_kwargs=torch_compile_kwargs,
    )
