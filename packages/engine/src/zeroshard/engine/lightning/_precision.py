"""Lightning's `precision` flag on zeroshard: the engine's compute dtype; the masters'
dtype is the config's (`master_dtype`, fp32 by default).

[Note: precision under the strategy]
zeroshard's own mixed precision replaces Lightning's autocast and GradScaler: the engine
keeps master shards (fp32 unless the config's `master_dtype` says bf16), casts them to
the compute dtype for forward and backward, casts float inputs to it, and under fp16
scales the loss itself. Lightning's precision flag picks that compute dtype:

- "32-true": fp32 compute;
- "bf16-mixed": bf16 compute (the whole forward, as DeepSpeed's bf16 does, not autocast's
  per-op choice), the config's masters and gradient shards (fp32 by default);
- "16-mixed": fp16 compute with the engine's dynamic loss scaling, fp32 masters;
- "bf16-true": the model is created and kept in bf16, as Lightning does, and computes
  in bf16; the masters the optimizer steps are the config's (fp32 by default, where
  plain Lightning would step bf16 weights; `master_dtype` bf16 steps bf16 ones).

Anything else ("16-true", "64-true", transformer-engine, bitsandbytes, a plugin of one's
own) has no meaning for the engine and is refused by name. The connector builds its own
plugin from the flag and sets it on the strategy; the strategies convert it here.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, cast

import torch
from lightning.fabric.plugins import precision as fabric_precision
from lightning.fabric.plugins.precision.utils import _DtypeContextManager
from lightning.pytorch.plugins import precision as trainer_precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn

from zeroshard.engine.runtime._optimizer import ZeroOptimizer

COMPUTE_DTYPES: dict[str, torch.dtype] = {
    "32-true": torch.float32,
    "bf16-mixed": torch.bfloat16,
    "16-mixed": torch.float16,
    "bf16-true": torch.bfloat16,
}
"""The precision flags the strategies take, and the engine's compute dtype for each."""

# The plugins Lightning's connectors build from the `precision` flag: read for their flag.
_FLAG_PLUGINS = (
    fabric_precision.Precision,
    fabric_precision.MixedPrecision,
    fabric_precision.HalfPrecision,
    fabric_precision.DoublePrecision,
    trainer_precision.Precision,
    trainer_precision.MixedPrecision,
    trainer_precision.HalfPrecision,
    trainer_precision.DoublePrecision,
)


def compute_dtype_of(precision: str) -> torch.dtype:
    """The engine's compute dtype for a Lightning precision flag; ValueError naming it if
    there is none (see [Note: precision under the strategy])."""
    dtype = COMPUTE_DTYPES.get(precision)
    if dtype is None:
        raise ValueError(
            f"zeroshard: precision={precision!r} is not supported; choose one of "
            f"{', '.join(COMPUTE_DTYPES)} (zeroshard keeps its master weights and computes "
            "in fp32, bf16 or fp16)"
        )
    return dtype


def flag_of(plugin: object) -> str:
    """The precision flag a plugin of Lightning's connector stands for; ValueError naming a
    plugin the engine cannot stand in for."""
    if isinstance(plugin, _EnginePrecision):
        return str(plugin.precision)
    if type(plugin) not in _FLAG_PLUGINS:
        raise ValueError(
            f"zeroshard: the precision plugin {type(plugin).__name__} is not supported: the "
            "engine owns precision; pass precision= one of " + ", ".join(COMPUTE_DTYPES)
        )
    flag = str(cast(fabric_precision.Precision, plugin).precision)
    compute_dtype_of(flag)
    return flag


class _EnginePrecision:
    """What both plugins do: nothing at forward (the engine casts), the model's dtype under
    "bf16-true"."""

    precision: Any

    def __init__(self, precision: str) -> None:
        compute_dtype_of(precision)
        self.precision = precision
        self.compute_dtype = COMPUTE_DTYPES[precision]
        # Under "bf16-true" the model itself is bf16 (init and conversion), as Lightning's.
        self._model_dtype = self.compute_dtype if precision.endswith("-true") else None

    def convert_module(self, module: nn.Module) -> nn.Module:
        """The module in bf16 under "bf16-true"; as it is otherwise."""
        return module if self._model_dtype is None else module.to(dtype=self._model_dtype)

    def tensor_init_context(self) -> AbstractContextManager[Any]:
        """New tensors in bf16 under "bf16-true"."""
        if self._model_dtype is None:
            return nullcontext()
        return _DtypeContextManager(self._model_dtype)

    def module_init_context(self) -> AbstractContextManager[Any]:
        """As `tensor_init_context`."""
        return self.tensor_init_context()


class ZeroShardPrecision(_EnginePrecision, trainer_precision.Precision):
    """The Trainer's precision plugin under `ZeroShardStrategy` (see [Note: precision under
    the strategy]); it clips by the global norm of the engine's gradient shards."""

    def __init__(self, precision: str) -> None:
        super().__init__(precision)
        self.grad_norm: torch.Tensor | None = None
        """The norm of the last clipping, until the strategy logs it."""

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: Any,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Run the closure (forward, backward, clipping), then the engine's step, which
        takes no closure."""
        result = closure()
        self._after_closure(model, optimizer)
        if result is None and model.automatic_optimization:
            # Every rank must step alike; one that skipped its backward would leave the
            # others waiting in the step's collectives.
            raise ValueError(
                "zeroshard: training_step returned None (skip the batch), which the engine "
                "cannot do on one rank alone; return a loss on every rank"
            )
        return optimizer.step(**kwargs)

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip by the global norm over every rank's gradient shard; clipping by value is
        refused (the engine keeps no whole gradients to clamp)."""
        if clip_val <= 0:
            return
        if gradient_clip_algorithm != GradClipAlgorithmType.NORM:
            raise ValueError(
                "zeroshard clips gradients by their global norm only: set "
                "Trainer(gradient_clip_algorithm='norm')"
            )
        self.grad_norm = engine_optimizer(optimizer).clip_grad_norm_(float(clip_val))


class ZeroShardFabricPrecision(_EnginePrecision, fabric_precision.Precision):
    """Fabric's precision plugin under `ZeroShardFabricStrategy` (see [Note: precision
    under the strategy])."""


def engine_optimizer(optimizer: Any) -> ZeroOptimizer:
    """The engine's optimizer under Lightning's wrappers (`LightningOptimizer`,
    `_FabricOptimizer`): what clips and steps."""
    inner = optimizer
    while not isinstance(inner, ZeroOptimizer):
        nested = getattr(inner, "_optimizer", None) or getattr(inner, "optimizer", None)
        if nested is None or nested is inner:
            raise ValueError(
                f"zeroshard: {type(optimizer).__name__} is not the optimizer the strategy set "
                "up (its engine's ZeroOptimizer)"
            )
        inner = nested
    return inner
