"""Dynamic loss scaling for fp16, with the overflow decision agreed across ranks."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

log = logging.getLogger("zeroshard.engine")


@dataclass
class LossScaler:
    """Halve the scale on overflow (down to `min_scale`); double it after `window` good steps.

    The caller decides overflow collectively (every rank must see the same answer, or
    ranks would skip different steps and their shards would drift apart).
    `skipped_steps` counts the steps skipped for overflow since initialize (or load);
    `log_skips` (rank 0) logs each one.
    """

    scale: float
    window: int
    min_scale: float
    good_steps: int = 0
    skipped_steps: int = 0
    log_skips: bool = False
    # The scale as a CPU tensor too, kept equal to `scale`: the gradient scaling reads it,
    # so a compiled graph takes it as an input and a new scale needs no recompilation.
    factor: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.factor = torch.tensor(self.scale, dtype=torch.float32)

    def __setattr__(self, name: str, value: object) -> None:
        super().__setattr__(name, value)
        if name == "scale" and "factor" in self.__dict__:
            self.factor.fill_(self.scale)

    def update(self, overflow: bool) -> None:
        """Record one step's outcome."""
        if overflow:
            self.skipped_steps += 1
            if self.log_skips:
                log.warning(
                    "fp16 overflow: step skipped (%d so far), loss scale %g -> %g",
                    self.skipped_steps,
                    self.scale,
                    max(self.scale / 2.0, self.min_scale),
                )
            self.scale = max(self.scale / 2.0, self.min_scale)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.window:
            self.scale *= 2.0
            self.good_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        """The scaler's state for checkpoints."""
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Restore `state_dict()` output."""
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
