"""DeepSpeed's engines: ZeRO stages 1-3 with its fastest overlap settings; with
`--optimizer muon`, DeepSpeed's own Muon (its config's `"type": "Muon"`, which puts the
matrices it tags by name on Muon and the rest on its Adam)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from benchmarks._common import LR
from benchmarks._common._models import MUON_LR
from benchmarks.train_step._settings import Settings, Stepper, make_optimizers


def setup_ds(model: nn.Module, s: Settings, stage: int) -> Stepper:
    """`deepspeed.initialize` at `stage` on the process group the benchmark made."""
    import deepspeed  # type: ignore[import-not-found, import-untyped, unused-ignore]

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # overlap_comm on for every stage: DeepSpeed's fastest setting, so the fair peer.
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}
    config: dict[str, object] = {
        "train_micro_batch_size_per_gpu": s.micro_batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": s.dtype == torch.bfloat16},
        "fp16": {"enabled": s.dtype == torch.float16},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": s.clip,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if s.optimizer == "muon":
        # torch.optim.Muon's defaults and the benchmark's AdamW, in DeepSpeed's keys (its
        # weight decay is one for both halves: Muon's, where the others' AdamW has torch's).
        params: dict[str, object] = {
            "muon_lr": MUON_LR,
            "adam_lr": LR,
            "momentum": 0.95,
            "weight_decay": 0.1,
        }
        # torch's AdamW for the rest (as the other engines), not DeepSpeed's FusedAdam,
        # which is built (JIT) on first use where its ops are not prebuilt.
        params |= {"betas": [0.9, 0.95], "torch_adam": True}
        config["optimizer"] = {"type": "Muon", "params": params}
        # DeepSpeed's ZeRO-3 refuses Muon with its reduce-scatter (it all-reduces instead).
        config["zero_optimization"] = {**zero, "reduce_scatter": stage != 3}
        with _muon_on(deepspeed, model):
            engine, *_ = deepspeed.initialize(
                model=model,
                model_parameters=model.parameters(),
                config=config,
                dist_init_required=False,
            )
    else:
        (optimizer,) = make_optimizers(model, s)
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=config, dist_init_required=False
        )

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()

    return step


@contextlib.contextmanager
def _muon_on(deepspeed: Any, model: nn.Module) -> Iterator[None]:
    """Within: DeepSpeed's Muon takes the hidden matrices every other engine gives Muon.
    DeepSpeed tags its Muon parameters by name (2-D, and neither "embed" nor "lm_head" in
    it), which would put examples/gpt.py's embeddings and examples/llama.py's head on
    Muon too; its tagging function is replaced for the call, and put back after."""
    from zeroshard.engine.planner._whole import hidden_matrices

    hidden = dict(zip(map(id, model.parameters()), hidden_matrices(model), strict=True))
    original = deepspeed.set_optimizer_flags

    def tag(config: Any, tagged: nn.Module) -> None:
        for p in tagged.parameters():
            p.use_muon = hidden[id(p)]  # type: ignore[attr-defined]

    deepspeed.set_optimizer_flags = tag
    try:
        yield
    finally:
        deepspeed.set_optimizer_flags = original
