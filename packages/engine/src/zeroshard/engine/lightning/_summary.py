"""Lightning's model summary of a stage-3 model: each parameter counted at its full size.

At stage 3 a rank holds a shard of every parameter and the parameter itself is empty
outside its unit's forward, so Lightning's summary counted 0 parameters (its DeepSpeed
strategy swaps in `DeepSpeedSummary`, which reads DeepSpeed's `ds_numel`). The sizes
here come from the flat groups' layouts: nothing is gathered.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Mapping

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelSummary as SummaryCallback
from lightning.pytorch.utilities.model_summary.model_summary import LayerSummary, ModelSummary
from torch import nn

from zeroshard.engine.runtime._state import engine_state


class _LayerSummary(LayerSummary):
    def __init__(self, module: nn.Module, numel: Mapping[int, int]) -> None:
        self._numel = numel
        super().__init__(module)

    @property
    def num_parameters(self) -> int:
        return sum(self._numel.get(id(p), p.numel()) for p in self._module.parameters())


class ShardedSummary(ModelSummary):
    """Lightning's `ModelSummary` with every parameter at its full size (`numel`: by the
    parameter's id)."""

    def __init__(self, model: pl.LightningModule, max_depth: int, numel: Mapping[int, int]):
        self._numel = numel
        super().__init__(model, max_depth)

    def summarize(self) -> dict[str, LayerSummary]:
        """Lightning's own, with layer summaries that count full sizes."""
        summary: dict[str, LayerSummary] = OrderedDict(
            (name, _LayerSummary(module, self._numel)) for name, module in self.named_modules
        )
        if self._model.example_input_array is not None:
            self._forward_example_input()
        for layer in summary.values():
            layer.detach_hook()
        if self._max_depth >= 1:
            for k in [k for k in summary if k.count(".") >= self._max_depth]:
                del summary[k]
        return summary

    @property
    def total_parameters(self) -> int:
        """Every parameter at its full size."""
        return sum(self._numel.get(id(p), p.numel()) for p in self._model.parameters())

    @property
    def trainable_parameters(self) -> int:
        """The trainable ones at their full size."""
        params = (p for p in self._model.parameters() if p.requires_grad)
        return sum(self._numel.get(id(p), p.numel()) for p in params)


def full_sizes(engine_model: nn.Module) -> dict[int, int]:
    """The whole size of each of the engine's parameters, by id (from the layouts)."""
    return {
        id(p): slot.numel
        for g in engine_state(engine_model).groups
        for p, slot in zip(g.params, g.layout.slots, strict=True)
    }


def _summary(
    trainer: pl.Trainer, module: pl.LightningModule, *, depth: int, numel: Mapping[int, int]
) -> ShardedSummary:
    return ShardedSummary(module, depth, numel)


def summarize_full_sizes(trainer: pl.Trainer, engine_model: nn.Module) -> None:
    """Have the Trainer's model summary callbacks count full sizes (stage 3)."""
    numel = full_sizes(engine_model)
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, SummaryCallback):
            # The callback's own `_summary` picks DeepSpeedSummary for DeepSpeed's
            # strategy alone; this instance attribute takes its place.
            callback._summary = functools.partial(  # type: ignore[method-assign]
                _summary, depth=callback._max_depth, numel=numel
            )
