"""zeroshard's engines: stages 1-3, the hybrids, stage 3 with compiled blocks, stage 3
compiled whole by zeroshard.compile, and the optimizer offloaded to the CPU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.train_step._settings import (
    NOTES,
    Settings,
    Stepper,
    dtype_name,
    hybrid_shape,
    make_optimizers,
)


def _initialize(model: nn.Module, s: Settings, stage: int, **extra: Any) -> tuple[Any, Any]:
    """`zs.initialize` with the run's dtype, optimizers and `--zs-config` (plus `extra`)."""
    import zeroshard.engine as zs

    config = {"stage": stage, "compute_dtype": dtype_name(s.dtype), **s.zs_config, **extra}
    return zs.initialize(model, make_optimizers(model, s), config)


def _train_step(forward: Callable[..., Any], opt: Any, s: Settings, x: Any, y: Any) -> None:
    """One zeroshard step: forward, backward, optional clipping, optimizer step."""
    forward(x, y).backward()
    if s.clip > 0:
        opt.clip_grad_norm_(s.clip)
    opt.step()
    opt.zero_grad()


# What an offload engine (`zs2-off`, ...) adds to the config: the masters and the
# optimizer's state on the host, stepped there (Muon's orthogonalization on the device).
OFFLOAD = {"offload_optimizer": True}


def setup_zs(
    model: nn.Module, s: Settings, stage: int, hybrid: bool = False, offload: bool = False
) -> Stepper:
    """zeroshard at `stage`; `hybrid`: shard within `shard_group_size` ranks; `offload`:
    the optimizer offloaded to the CPU."""
    extra = {"shard_group_size": hybrid_shape(s)[1]} if hybrid else {}
    zmodel, opt = _initialize(model, s, stage, **extra, **(OFFLOAD if offload else {}))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        _train_step(zmodel, opt, s, x, y)

    return step


def setup_zs3_noted(model: nn.Module, s: Settings, name: str) -> Stepper:
    """zeroshard stage 3, noting the bytes gathered per step and the fp8 weights' scale
    all-reduces once, on rank 0, for the report (NOTES, under the engine's `name`)."""
    import zeroshard.engine as zs

    zmodel, opt = _initialize(model, s, 3)
    stats = zs.engine_stats(zmodel)
    steps = 0

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        nonlocal steps
        stats.reset()
        _train_step(zmodel, opt, s, x, y)
        steps += 1
        if steps == 2 and dist.get_rank() == 0:
            note = (
                f"per step: {stats.gathers} gathers, "
                f"{stats.bytes_gathered / 2**20:.1f} MiB gathered, "
                f"{stats.scale_reductions} fp8 scale all-reduce(s)"
            )
            NOTES[name] = note
            print(f"[{name}] {note}", flush=True)

    return step


def setup_zs3b(model: nn.Module, s: Settings) -> Stepper:
    """zeroshard stage 3 with every block's `forward` under torch.compile, as a torchtitan
    user compiles blocks: the engine's hooks run eagerly around the blocks' graphs, and one
    graph serves every block of the same shape (the like-for-like of `fsdp2c`). The
    forward, not the module: a module compiled after `initialize` traces the engine's
    hooks too (see docs/compile.md)."""
    step = setup_zs(model, s, 3)  # the engine keeps the model's block modules
    blocks: Any = model.blocks
    for block in blocks:
        block.forward = torch.compile(block.forward, fullgraph=True)
    return step


def setup_zs3c(
    model: nn.Module, s: Settings, fuse_downcast: bool, name: str, offload: bool = False
) -> Stepper:
    """zeroshard stage 3 compiled whole by zeroshard.compile (inductor), `offload`: with
    the optimizer offloaded to the CPU; records the bytes gathered per step once, on rank
    0, for the report (NOTES, under the engine's `name`)."""
    import zeroshard.compile as zc

    zmodel, opt = _initialize(model, s, 3, **(OFFLOAD if offload else {}))
    pipeline = zc.default_pipeline()
    if not fuse_downcast:
        pipeline = pipeline.without("fuse_downcast")
    compiled = zc.compile(zmodel, pipeline=pipeline)
    steps = 0

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        nonlocal steps
        compiled.stats.reset()
        _train_step(compiled, opt, s, x, y)
        steps += 1
        if steps == 2 and dist.get_rank() == 0:
            st = compiled.stats
            note = (
                f"per step: {st.gathers} gathers, "
                f"{st.bytes_gathered / 2**20:.1f} MiB gathered, "
                f"{st.bytes_reduced / 2**20:.1f} MiB reduce-scattered, "
                f"peak gathered {st.peak_live_bytes / 2**20:.1f} MiB, "
                f"captures {compiled.compiles}, eager fallback {compiled.eager}"
            )
            NOTES[name] = note
            print(f"[{name}] {note}", flush=True)

    return step
