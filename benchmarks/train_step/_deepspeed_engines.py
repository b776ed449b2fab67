"""DeepSpeed's engines: ZeRO stages 1-3 with its fastest overlap settings."""

from __future__ import annotations

import logging

import torch
from torch import nn

from benchmarks._common import adamw
from benchmarks.train_step._settings import Settings, Stepper


def setup_ds(model: nn.Module, s: Settings, stage: int) -> Stepper:
    """`deepspeed.initialize` at `stage` on the process group the benchmark made."""
    import deepspeed  # type: ignore[import-not-found, import-untyped, unused-ignore]

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    config = {
        "train_micro_batch_size_per_gpu": s.micro_batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": s.dtype == torch.bfloat16},
        "fp16": {"enabled": s.dtype == torch.float16},
        # overlap_comm on for every stage: DeepSpeed's fastest setting, so the fair peer.
        "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": s.clip,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=adamw(model.parameters(), s.device),
        config=config,
        dist_init_required=False,
    )

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()

    return step
