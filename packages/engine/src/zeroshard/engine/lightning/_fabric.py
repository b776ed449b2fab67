"""`ZeroShardFabricStrategy`: `lightning.fabric.Fabric` on zeroshard.

    fabric = Fabric(strategy="zeroshard_stage_3", precision="bf16-mixed")
    model, optimizer = fabric.setup(model, optimizer)   # sharded by the engine
    fabric.backward(loss); fabric.clip_gradients(model, optimizer, max_norm=1.0)
    optimizer.step(); optimizer.zero_grad()
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": step})
    fabric.load(path, state)   # at any world size

Fabric's DDPStrategy with the engine in DistributedDataParallel's place: `setup` shards
the model and its optimizer together on the root of [Note: the engine's root] (Fabric
calls the model through it); `fabric.setup(model)` alone shards it for evaluation.
`fabric.init_module(empty_init=True)` builds on the meta device at stage 3.
`no_backward_sync` does nothing: the engine reduces every backward into its gradient
shards, and accumulating over several backwards needs nothing more.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.accelerators.accelerator import Accelerator
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies.ddp import DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.types import _PATH, _Stateful
from torch import nn
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer

from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.lightning._checkpoint import load_sharded, save_sharded
from zeroshard.engine.lightning._config import ConfigSource, LoopSettings, engine_config
from zeroshard.engine.lightning._engine import EngineRoot, build_engine, engine_root, reuse_engine
from zeroshard.engine.lightning._precision import (
    ZeroShardFabricPrecision,
    engine_optimizer,
    flag_of,
)
from zeroshard.engine.lightning._registry import register


class _EngineBackwardSync(_BackwardSyncControl):
    """`fabric.no_backward_sync` under the engine: nothing to skip (see the module doc)."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager[Any]:
        """A context that changes nothing."""
        return nullcontext()


class ZeroShardFabricStrategy(DDPStrategy):
    """Fabric with zeroshard: `Fabric(strategy=ZeroShardFabricStrategy(config))` or by name,
    `Fabric(strategy="zeroshard_stage_3")` (see `STRATEGIES`).

    `config` is a `ZeroConfig` or its dict (default: stage 2), or a DeepSpeed config (its
    batch, accumulation and clipping keys are the loop's and not read). `precision` picks
    the compute dtype. The other arguments are Fabric's DDPStrategy's.
    """

    strategy_name = "zeroshard"

    def __init__(
        self,
        config: ConfigSource = None,
        *,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self._config_source = config
        self._config: ZeroConfig | None = None
        self._backward_sync_control = _EngineBackwardSync()

    # -- precision -----------------------------------------------------------------------
    @property
    def precision(self) -> ZeroShardFabricPrecision:
        """The engine's plugin for Fabric's precision flag ("32-true" by default)."""
        if not isinstance(self._precision, ZeroShardFabricPrecision):
            self._precision = ZeroShardFabricPrecision("32-true")
        return self._precision

    @precision.setter
    def precision(self, plugin: Precision | None) -> None:
        # The connector sets the plugin it built from the flag: the engine's stands in.
        if plugin is not None and not isinstance(plugin, ZeroShardFabricPrecision):
            plugin = ZeroShardFabricPrecision(flag_of(plugin))
        self._precision = plugin

    # -- the engine ----------------------------------------------------------------------
    def zero_config(self) -> ZeroConfig:
        """The engine's config: `config` with the precision flag applied."""
        if self._config is None:
            loop = LoopSettings(self.precision.precision, None, None)
            self._config = engine_config(self._config_source, loop, rank_zero=self.is_global_zero)
        return self._config

    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager[Any]:
        """`fabric.init_module()`: with `empty_init=True` at stage 3 on the meta device (the
        engine materializes each unit on the device when the model is set up)."""
        if not (empty_init and self.zero_config().stage == 3):
            return super().module_init_context(empty_init)
        stack = ExitStack()
        stack.enter_context(torch.device("meta"))
        stack.enter_context(self.precision.module_init_context())
        return stack

    def module_to_device(self, module: nn.Module) -> None:
        """The module to this rank's device; a meta-device one stays (stage 3)."""
        if not any(p.is_meta for p in module.parameters()):
            module.to(self.root_device)

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[Optimizer], Any]:
        """Shard `module` with its one optimizer (built on its parameters, no state yet)."""
        if len(optimizers) != 1:
            raise ValueError(
                f"zeroshard: fabric.setup got {len(optimizers)} optimizers; the engine shards one "
                "here (several, such as torch's Muon recipe: zs.initialize(model, [muon, "
                "adamw], config) without Fabric)"
            )
        if reuse_engine(module, self.zero_config(), training=True) is not None:
            raise ValueError("zeroshard: this module was set up already; set it up once")
        root = build_engine(module, optimizers[0], self.zero_config())
        assert root.optimizer is not None  # built with one
        return root, [root.optimizer], scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:  # type: ignore[override]
        """`fabric.setup(model)` without an optimizer: sharded for evaluation only."""
        root = reuse_engine(module, self.zero_config(), training=False)
        return root if root is not None else build_engine(module, None, self.zero_config())

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Refused: the engine shards a model and its optimizer together."""
        raise ValueError(
            "zeroshard: set up the model and its optimizer together: "
            "model, optimizer = fabric.setup(model, optimizer)"
        )

    # -- clipping ------------------------------------------------------------------------
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip by the global norm over every rank's gradient shard; return that norm."""
        norm = engine_optimizer(optimizer).clip_grad_norm_(float(max_norm), float(norm_type))
        # Under fp16 an infinite norm is an overflow: the engine skips that step itself.
        if error_if_nonfinite and self.precision.precision != "16-mixed" and not norm.isfinite():
            raise RuntimeError(
                f"zeroshard: the total norm of the gradients is {float(norm)}; "
                "pass error_if_nonfinite=False to fabric.clip_gradients to step anyway"
            )
        return norm

    def clip_gradients_value(
        self, module: nn.Module, optimizer: Optimizer, clip_val: float | int
    ) -> None:
        """Refused: the engine keeps no whole gradients to clamp."""
        raise ValueError("zeroshard clips gradients by their global norm only: pass max_norm=")

    # -- checkpoints ---------------------------------------------------------------------
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Write the sharded checkpoint directory `path` (see [Note: a Lightning checkpoint
        on disk]): the set-up model and its optimizer as shards, every other entry (plain
        data, or its `state_dict()`) beside them. Call on every rank."""
        if storage_options is not None or filter:
            raise TypeError(
                "zeroshard: fabric.save(storage_options=..., filter=...) is not supported: "
                "the checkpoint holds the whole sharded state"
            )
        root, rest = _split_state(state)
        converted = {k: v.state_dict() if isinstance(v, _Stateful) else v for k, v in rest.items()}
        save_sharded(root, self.broadcast(path), converted, step=0)

    def load_checkpoint(
        self,
        path: _PATH,
        state: nn.Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint `save_checkpoint` wrote, at any world size: the shards into
        the set-up model in `state`, every other entry of `state` in place (objects) or
        into `state` (plain data); return the saved entries `state` did not ask for.
        Nothing is unpickled, so `weights_only` changes nothing."""
        if isinstance(state, Optimizer):
            raise ValueError("zeroshard: load into the set-up model: fabric.load(path, {...})")
        wanted = {"model": state} if isinstance(state, nn.Module) else dict(state or {})
        root, rest = _split_state(wanted)
        saved = load_sharded(root, self.broadcast(path))
        missing = sorted(set(rest) - set(saved))
        if strict and missing:
            raise KeyError(
                f"zeroshard: the checkpoint {path} has no entries {missing} (it holds "
                f"{sorted(saved)}); pass strict=False to load the others"
            )
        for key, obj in rest.items():
            if key not in saved:
                continue
            if isinstance(obj, _Stateful):
                obj.load_state_dict(saved.pop(key))
            elif isinstance(state, Mapping):
                state[key] = saved.pop(key)
        return saved

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register `zeroshard`, `zeroshard_stage_1` ... `zeroshard_stage_3_offload`."""
        register(strategy_registry, cls)


def _split_state(state: Mapping[str, Any]) -> tuple[EngineRoot, dict[str, Any]]:
    """The one set-up model of a Fabric state dict, and its entries other than that model
    and its optimizer; ValueError naming the problem otherwise."""
    roots = {k: r for k, v in state.items() if isinstance(v, nn.Module) and (r := engine_root(v))}
    if len(roots) != 1:
        found = sorted(roots) or "none"
        raise ValueError(
            "zeroshard: the state must hold exactly one model set up by fabric.setup (its "
            f"shards are the checkpoint), found {found}"
        )
    ((key, root),) = roots.items()
    mine = {id(root.optimizer)} if root.optimizer is not None else set()
    rest = {k: v for k, v in state.items() if k != key and id(v) not in mine}
    return root, rest
