"""`ZeroShardStrategy`: `lightning.pytorch.Trainer` on zeroshard.

[Note: which Trainer hooks the strategy replaces]
It is Lightning's DDPStrategy (processes, launchers, process group, sampler, barrier,
reduce) with the model and optimizer handed to the engine instead of DistributedDataParallel:
- `setup`: `configure_optimizers`' one optimizer and the module are sharded by
  `initialize`, on the root of [Note: the engine's root], which becomes `self.model`:
  Lightning then routes every step method through its `forward`. A later `fit`, `test` or
  Trainer on the same module reuses the engine; validate/test/predict before any fit
  build one for evaluation only.
- `model_sharded_context`: `configure_model` builds on the meta device at stage 3; the
  engine materializes each unit on the device (`reset_parameters()`), shards it, frees it.
- precision: the plugin is the engine's (see [Note: precision under the strategy]);
  clipping is the global norm over the gradient shards, logged as `grad_norm`; the step
  runs the closure first (the engine's step takes none).
- checkpoints: see [Note: a Lightning checkpoint on disk]; loading happens after setup
  (the shards go into the engine), Lightning restores loops, callbacks and schedulers
  from what was saved beside them.
- teardown moves nothing to the CPU: the engine keeps its memory for a later test or save.
- the model summary (callback) counts each stage-3 parameter at its full size (_summary.py).
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer

from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.config._deepspeed_config import hidden_size_of
from zeroshard.engine.lightning._checkpoint import SHARDED_KEYS, load_sharded, save_sharded
from zeroshard.engine.lightning._config import ConfigSource, LoopSettings, engine_config
from zeroshard.engine.lightning._engine import EngineRoot, build_engine, engine_root, reuse_engine
from zeroshard.engine.lightning._precision import ZeroShardPrecision, flag_of
from zeroshard.engine.lightning._registry import register
from zeroshard.engine.lightning._summary import summarize_full_sizes


class ZeroShardStrategy(DDPStrategy):
    """Train a LightningModule with zeroshard: `Trainer(strategy=ZeroShardStrategy(config))`
    or by name, `Trainer(strategy="zeroshard_stage_3")` (see `STRATEGIES`).

    `config` is a `ZeroConfig` or its dict (default: stage 2), or a DeepSpeed config (a
    dict or a `ds_config.json` path). The Trainer's `precision`, `accumulate_grad_batches`
    and `gradient_clip_val` keep their meaning; a config that contradicts them is refused
    by name. The other arguments are DDPStrategy's.
    """

    strategy_name = "zeroshard"

    def __init__(
        self,
        config: ConfigSource = None,
        *,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self._config_source = config
        self._config: ZeroConfig | None = None

    # -- precision -----------------------------------------------------------------------
    @property
    def precision_plugin(self) -> ZeroShardPrecision:
        """The engine's plugin for the Trainer's precision flag ("32-true" by default)."""
        if not isinstance(self._precision_plugin, ZeroShardPrecision):
            self._precision_plugin = ZeroShardPrecision("32-true")
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # The connector sets the plugin it built from the flag: the engine's stands in.
        if plugin is not None and not isinstance(plugin, ZeroShardPrecision):
            plugin = ZeroShardPrecision(flag_of(plugin))
        self._precision_plugin = plugin

    # -- the engine ----------------------------------------------------------------------
    def zero_config(self) -> ZeroConfig:
        """The engine's config: `config` with the Trainer's settings applied (once
        connected to a Trainer)."""
        if self._config is None:
            module = self._module()
            trainer = module.trainer
            clip = trainer.gradient_clip_val
            algorithm = trainer.gradient_clip_algorithm or GradClipAlgorithmType.NORM
            if clip and algorithm != GradClipAlgorithmType.NORM:
                raise ValueError(
                    "zeroshard clips gradients by their global norm only: set "
                    "Trainer(gradient_clip_algorithm='norm')"
                )
            loop = LoopSettings(
                precision=self.precision_plugin.precision,
                accumulate_grad_batches=trainer.accumulate_grad_batches,
                gradient_clip_val=float(clip or 0.0),
                hidden_size=hidden_size_of(module),
            )
            self._config = engine_config(self._config_source, loop, rank_zero=self.is_global_zero)
        return self._config

    def _module(self) -> pl.LightningModule:
        module = self.lightning_module
        if module is None:
            raise RuntimeError("zeroshard: the strategy is not connected to a LightningModule yet")
        return module

    def _root(self) -> EngineRoot:
        root = engine_root(self._module())
        if root is None:
            raise RuntimeError("zeroshard: the model is sharded when fit/validate/test starts")
        return root

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Around `configure_model`: at stage 3 on the meta device (sharded unit by unit)."""
        if self.zero_config().stage == 3:
            with torch.device("meta"):
                yield
        else:
            yield

    def model_to_device(self) -> None:
        """The model to this rank's device; a meta-device one stays (stage 3 materializes
        each unit on the device)."""
        assert self.model is not None
        if not any(p.is_meta for p in self.model.parameters()):
            self.model.to(self.root_device)

    def setup(self, trainer: pl.Trainer) -> None:
        """Shard the module and `configure_optimizers`' optimizer (see [Note: which
        Trainer hooks the strategy replaces])."""
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        if self._layer_sync is not None:
            raise ValueError("zeroshard: Trainer(sync_batchnorm=True) is not supported")
        module = self._module()
        config = self.zero_config()
        training = trainer.state.fn == TrainerFn.FITTING
        root = reuse_engine(module, config, training=training)
        if root is None:
            self.precision_plugin.convert_module(module)
            self.model_to_device()
            optimizer: Optimizer | None = None
            schedulers: list[Any] = []
            if training:
                optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
                if len(optimizers) != 1:
                    raise ValueError(
                        f"zeroshard: configure_optimizers returned {len(optimizers)} "
                        "optimizers; the engine shards one here (several, such as torch's "
                        "Muon recipe: zs.initialize(model, [muon, adamw], config) without "
                        "Lightning)"
                    )
                optimizer = optimizers[0]
            root = build_engine(module, optimizer, config)
            root.schedulers = schedulers
        self.model = root
        if training:
            assert root.optimizer is not None  # reuse_engine refuses an evaluation-only one
            self.optimizers = [root.optimizer]
            self.lr_scheduler_configs = list(root.schedulers)
        if config.stage == 3:
            summarize_full_sizes(trainer, root)
        self.setup_precision_plugin()

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Any,
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """The step (closure, clipping, the engine's step); logs the clipped norm."""
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        norm, self.precision_plugin.grad_norm = self.precision_plugin.grad_norm, None
        if norm is not None:
            self._module().log("grad_norm", norm, on_step=True, on_epoch=False)
        return output

    def teardown(self) -> None:
        """Tear down the process environment; the engine keeps the model where it is."""
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # -- checkpoints ---------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """The shards load into the engine, so after `setup` built it."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        """The optimizer state comes back with the shards."""
        return False

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Empty: a checkpoint's weights are the shards (full weights: `zs.full_state_dict`)."""
        return {}

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, torch.Tensor]:
        """Empty: a checkpoint's optimizer state is the shards'."""
        return {}

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        """Write the sharded checkpoint directory `filepath` (see [Note: a Lightning
        checkpoint on disk]); every rank writes its shards."""
        if storage_options is not None:
            raise TypeError(
                "zeroshard: save_checkpoint(storage_options=...) is not supported: "
                "checkpoints are written by zeroshard, not by a CheckpointIO"
            )
        path = self.broadcast(filepath)
        kept = {k: v for k, v in checkpoint.items() if k not in SHARDED_KEYS}
        save_sharded(self._root(), path, kept, step=int(checkpoint.get("global_step", 0)))

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> Any:
        """Load a checkpoint `save_checkpoint` wrote, at any world size, into the engine;
        return what Lightning saved beside the shards. Nothing is unpickled, so
        `weights_only` changes nothing."""
        return load_sharded(self._root(), self.broadcast(checkpoint_path))

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: `load_checkpoint` loaded the weights into the engine."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: `load_checkpoint` loaded the optimizer state into the engine."""

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register `zeroshard`, `zeroshard_stage_1` ... `zeroshard_stage_3_offload`."""
        register(strategy_registry, cls)
