"""The engines that benchmarks/train_step.py times, each behind one `setup(...)` function.

Every setup takes a freshly built fp32 model on the benchmark device and returns a
`Stepper`: one call is one full training step (forward, backward, optimizer step, zero
grad) on a micro-batch. All engines use torch.optim.AdamW (fused on CUDA) with the same
hyperparameters; what differs is only how parameters, gradients and optimizer state are
distributed and cast.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

Stepper = Callable[[torch.Tensor, torch.Tensor], None]
LR = 1e-4


@dataclass(frozen=True)
class Settings:
    """What every engine shares: device, compute dtype, clipping, micro-batch, extras."""

    device: torch.device
    dtype: torch.dtype
    clip: float
    micro_batch: int
    zs_config: dict[str, Any]
    shard_group_size: int = 2  # hybrid engines: shard within this many ranks


class Skipped(Exception):
    """An engine that does not apply to this world (a row says why; not a failure)."""


@dataclass(frozen=True)
class Engine:
    """A name, a one-line description, a setup function and whether it can be imported.

    `what` may name `{shard}` and `{replicate}`: the hybrid group sizes of the run.
    """

    name: str
    what: str
    setup: Callable[[nn.Module, Settings], Stepper]
    available: Callable[[], bool]
    rank0_only: bool = False


def _adamw(params: Any, device: torch.device) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), fused=device.type == "cuda")


def _autocast(s: Settings) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast(s.device.type, dtype=s.dtype, enabled=s.dtype != torch.float32)


def _plain_step(
    model: nn.Module, opt: torch.optim.Optimizer, s: Settings, autocast: bool
) -> Stepper:
    """forward (under autocast if asked), backward, optional clip, step, zero_grad."""

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with _autocast(s) if autocast else contextlib.nullcontext():
            loss = model(x, y)
        loss.backward()
        if s.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), s.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def setup_floor(model: nn.Module, s: Settings) -> Stepper:
    """One device, no communication: the model in the compute dtype, AdamW on it directly.

    This is the least work any engine can do per step: the same matmuls in the compute
    dtype as the sharded engines, no casts of fp32 weights (autocast would add them), no
    master copy and no collectives.
    """
    model.to(s.dtype)
    return _plain_step(model, _adamw(model.parameters(), s.device), s, autocast=False)


def _compile_blocks(model: nn.Module) -> None:
    """Replace every block of `model.blocks` by `torch.compile(block, fullgraph=True)`."""
    blocks: Any = model.blocks
    for i, block in enumerate(blocks):
        blocks[i] = torch.compile(block, fullgraph=True)


def setup_floorc(model: nn.Module, s: Settings) -> Stepper:
    """The floor with every block under torch.compile: what the compiled engines (`zs3c`,
    `fsdp2c`) would run at best, so their ratio to it is the cost of sharding alone."""
    _compile_blocks(model)
    return setup_floor(model, s)


def setup_ddp(model: nn.Module, s: Settings) -> Stepper:
    """torch DistributedDataParallel (default buckets) with autocast."""
    from torch.nn.parallel import DistributedDataParallel

    ids = [s.device.index] if s.device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=ids)
    return _plain_step(ddp, _adamw(ddp.parameters(), s.device), s, autocast=True)


def _fully_shard() -> tuple[Any, Any]:
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6 kept FSDP2 under _composable
        from torch.distributed._composable.fsdp import (  # type: ignore[attr-defined]
            MixedPrecisionPolicy,
            fully_shard,
        )
    return fully_shard, MixedPrecisionPolicy


def hybrid_shape(s: Settings) -> tuple[int, int]:
    """(replicate, shard) group sizes of a hybrid engine; `Skipped` where it would not be one."""
    world, shard = dist.get_world_size(), s.shard_group_size
    if world % shard or world == shard:
        raise Skipped(
            f"shard within {shard} needs {2 * shard}, {3 * shard}, ... ranks, not {world}"
        )
    return world // shard, shard


def _setup_fsdp2(
    model: nn.Module, s: Settings, reshard_after_forward: bool, hybrid: bool = False
) -> Stepper:
    from torch.distributed.device_mesh import init_device_mesh

    fully_shard, policy_cls = _fully_shard()
    if hybrid:
        # A 2-D mesh makes fully_shard shard over the last dimension and replicate (HSDP:
        # all-reduce of the gradient shards) over the first.
        mesh = init_device_mesh(
            s.device.type, hybrid_shape(s), mesh_dim_names=("replicate", "shard")
        )
    else:
        mesh = init_device_mesh(s.device.type, (dist.get_world_size(),))
    low = None if s.dtype == torch.float32 else s.dtype
    policy = policy_cls(param_dtype=low, reduce_dtype=torch.float32)
    blocks: Any = model.blocks
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    # The root's parameters (embeddings, final norm) are needed last in backward anyway.
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return _plain_step(model, _adamw(model.parameters(), s.device), s, autocast=False)


def setup_fsdp2(model: nn.Module, s: Settings) -> Stepper:
    """FSDP2 fully_shard per block and root, bf16 params, fp32 reduce (ZeRO-3)."""
    return _setup_fsdp2(model, s, reshard_after_forward=True)


def setup_fsdp2_zero2(model: nn.Module, s: Settings) -> Stepper:
    """FSDP2 with reshard_after_forward=False: parameters stay gathered (ZeRO-2 analogue)."""
    return _setup_fsdp2(model, s, reshard_after_forward=False)


def setup_fsdp2_hybrid(model: nn.Module, s: Settings) -> Stepper:
    """FSDP2 HSDP: shard within `shard_group_size` ranks, replicate across the rest."""
    return _setup_fsdp2(model, s, reshard_after_forward=True, hybrid=True)


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def _zs_initialize(model: nn.Module, s: Settings, stage: int, **extra: Any) -> tuple[Any, Any]:
    """`zs.initialize` with the run's dtype, AdamW and `--zs-config` (plus `extra`)."""
    import zeroshard.engine as zs

    config = {"stage": stage, "compute_dtype": _dtype_name(s.dtype), **s.zs_config, **extra}
    return zs.initialize(model, _adamw(model.parameters(), s.device), config)


def _zs_train_step(forward: Callable[..., Any], opt: Any, s: Settings, x: Any, y: Any) -> None:
    """One zeroshard step: forward, backward, optional clipping, optimizer step."""
    forward(x, y).backward()
    if s.clip > 0:
        opt.clip_grad_norm_(s.clip)
    opt.step()
    opt.zero_grad()


def _setup_zs(model: nn.Module, s: Settings, stage: int, hybrid: bool = False) -> Stepper:
    extra = {"shard_group_size": hybrid_shape(s)[1]} if hybrid else {}
    zmodel, opt = _zs_initialize(model, s, stage, **extra)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        _zs_train_step(zmodel, opt, s, x, y)

    return step


def _setup_ds(model: nn.Module, s: Settings, stage: int) -> Stepper:
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
        optimizer=_adamw(model.parameters(), s.device),
        config=config,
        dist_init_required=False,
    )

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()

    return step


def setup_fsdp2c(model: nn.Module, s: Settings) -> Stepper:
    """FSDP2 as `fsdp2`, each block wrapped in torch.compile first (as torchtitan does):
    fully_shard then hooks the wrapper, so its gathers stay outside the compiled blocks."""
    _compile_blocks(model)
    return _setup_fsdp2(model, s, reshard_after_forward=True)


# The engines whose blocks run compiled: their floor is `floorc`, not `floor`.
COMPILED = frozenset({"floorc", "zs3c", "zs3c-nofuse", "fsdp2c"})

# Per-engine lines for the report (rank 0), e.g. the bytes a compiled step gathers.
NOTES: dict[str, str] = {}


def _setup_zs3c(model: nn.Module, s: Settings, fuse_downcast: bool) -> Stepper:
    """zeroshard stage 3 compiled whole by zeroshard.compile (inductor); records the bytes
    gathered per step once, on rank 0, for the report (NOTES)."""
    import zeroshard.compile as zc

    zmodel, opt = _zs_initialize(model, s, 3)
    pipeline = zc.default_pipeline()
    if not fuse_downcast:
        pipeline = pipeline.without("fuse_downcast")
    compiled = zc.compile(zmodel, pipeline=pipeline)
    steps = 0

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        nonlocal steps
        compiled.stats.reset()
        _zs_train_step(compiled, opt, s, x, y)
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
            NOTES["zs3c" if fuse_downcast else "zs3c-nofuse"] = note
            print(f"[zs3c fuse_downcast={fuse_downcast}] {note}", flush=True)

    return step


def _has(module: str, attr: str | None = None) -> Callable[[], bool]:
    """Whether `module` can be found (and, if `attr`, imported and has it)."""

    def check() -> bool:
        try:
            if importlib.util.find_spec(module) is None:
                return False
            return attr is None or hasattr(importlib.import_module(module), attr)
        except Exception:  # a broken install is "not available"
            return False

    return check


def _always() -> bool:
    return True


def _zs(stage: int, hybrid: bool = False) -> Callable[[nn.Module, Settings], Stepper]:
    return lambda m, s: _setup_zs(m, s, stage, hybrid)


def _ds(stage: int) -> Callable[[nn.Module, Settings], Stepper]:
    return lambda m, s: _setup_ds(m, s, stage)


# train_step.py runs DeepSpeed's engines last whatever their place here: importing and
# initializing it sets process-wide state (its accelerator, logging, hooks), which must not
# touch the engines timed before it.
ENGINES: dict[str, Engine] = {
    e.name: e
    for e in [
        Engine(
            "floor",
            "1 device, no communication, model in the compute dtype",
            setup_floor,
            _always,
            True,
        ),
        Engine(
            "floorc",
            "the floor with every block torch.compile'd",
            setup_floorc,
            _always,
            True,
        ),
        Engine("ddp", "torch DDP + autocast", setup_ddp, _always),
        Engine("fsdp2", "FSDP2 fully_shard per block (ZeRO-3)", setup_fsdp2, _always),
        Engine("fsdp2-zero2", "FSDP2, reshard_after_forward=False", setup_fsdp2_zero2, _always),
        *(
            Engine(
                f"zs{k}",
                f"zeroshard stage {k}",
                _zs(k),
                _has("zeroshard.engine", "initialize"),
            )
            for k in (1, 2, 3)
        ),
        *(
            # `available` finds deepspeed without importing it (see the note above).
            Engine(
                f"ds{k}",
                f"DeepSpeed ZeRO stage {k}",
                _ds(k),
                _has("deepspeed"),
            )
            for k in (1, 2, 3)
        ),
        *(
            Engine(
                f"zs{k}h",
                f"zeroshard stage {k}, hybrid: shard within {{shard}}, replicate across "
                "{replicate}",
                _zs(k, hybrid=True),
                _has("zeroshard.engine", "initialize"),
            )
            for k in (2, 3)
        ),
        Engine(
            "fsdp2h",
            "FSDP2 HSDP: shard within {shard}, replicate across {replicate}",
            setup_fsdp2_hybrid,
            _always,
        ),
        # zeroshard.compile: compiled stage 3 and its peer, FSDP2 with compiled blocks.
        Engine(
            "zs3c",
            "zeroshard stage 3, compiled (zeroshard.compile, inductor)",
            lambda m, s: _setup_zs3c(m, s, fuse_downcast=True),
            _has("zeroshard.compile", "compile"),
        ),
        Engine(
            "zs3c-nofuse",
            "zs3c without the fused downcast (fp32 gathers, then cast)",
            lambda m, s: _setup_zs3c(m, s, fuse_downcast=False),
            _has("zeroshard.compile", "compile"),
        ),
        Engine(
            "fsdp2c",
            "FSDP2 per block (ZeRO-3), each block torch.compile'd",
            setup_fsdp2c,
            _always,
        ),
    ]
}
