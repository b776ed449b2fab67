"""What `initialize` would refuse of a plan's combination of features, asked of the
runtime's own rules before anything is priced (docs/config.md's `## Composition`), and
the combinations whose step time the planner does not project."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.planner._step_time import check_step_in_backward
from zeroshard.engine.runtime.whole import (
    WHOLE_STEP_IS_COLLECTIVE,
    steps_whole,
)


def check_composition(
    cfg: ZeroConfig, optimizers: Sequence[torch.optim.Optimizer], *, step_in_backward: bool
) -> None:
    """ValueError naming why, where the engine refuses training by `optimizers` under
    `cfg`, stepping in backward or not."""
    if step_in_backward:
        check_step_in_backward(cfg)
        if optimizers and all(steps_whole(o) for o in optimizers):
            # The whole-matrix steppers' own refusal (AfterBackward.step_in_backward): they
            # step at step(), beside another optimizer's groups stepped in backward.
            raise ValueError(f"step_in_backward: {WHOLE_STEP_IS_COLLECTIVE}")


def check_step_priced(cfg: ZeroConfig, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """ValueError naming why, where an offloaded step's time would be projected but its
    host step is not modelled ([Note: the offload model] in _step_time.py: fused AdamW
    over fp32 masters): bf16 masters, a whole-matrix optimizer (Muon)."""
    if not cfg.offload.optimizer:
        return
    drop = "prices memory only: drop --step-ms / --achieved-tflops"
    if cfg.precision.master_dtype != torch.float32:
        raise ValueError(
            "--master-dtype bf16 with --offload "
            f"{drop} (the host step is modelled on fused AdamW over fp32 masters)"
        )
    whole = [type(o).__name__ for o in optimizers if steps_whole(o)]
    if whole:
        raise ValueError(
            f"--optimizer {whole[0].lower()} with --offload "
            f"{drop} (the host step is modelled on fused AdamW's, not {whole[0]}'s)"
        )
