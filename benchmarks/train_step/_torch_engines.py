"""torch's own engines: the no-communication floors, DDP and FSDP2 (plain, ZeRO-2-like,
hybrid, with compiled blocks)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.train_step._settings import Settings, Stepper, hybrid_shape, make_optimizers


def _autocast(s: Settings) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast(s.device.type, dtype=s.dtype, enabled=s.dtype != torch.float32)


def plain_step(
    model: nn.Module,
    opts: list[torch.optim.Optimizer],
    s: Settings,
    autocast: bool,
    after_step: Callable[[], None] | None = None,
) -> Stepper:
    """forward (under autocast if asked), backward, optional clip, each optimizer's step,
    `after_step`, zero_grad."""

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with _autocast(s) if autocast else contextlib.nullcontext():
            loss = model(x, y)
        loss.backward()
        if s.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), s.clip)
        for opt in opts:
            opt.step()
        if after_step is not None:
            after_step()
        for opt in opts:
            opt.zero_grad(set_to_none=True)

    return step


def setup_floor(model: nn.Module, s: Settings) -> Stepper:
    """One device, no communication: the model in the compute dtype, the run's optimizers
    on it directly.

    This is the least work any engine can do per step: the same matmuls in the compute
    dtype as the sharded engines, no casts of fp32 weights (autocast would add them), no
    master copy and no collectives.
    """
    model.to(s.dtype)
    return plain_step(model, make_optimizers(model, s), s, autocast=False)


def setup_floor32(model: nn.Module, s: Settings) -> Stepper:
    """One device, no communication, mixed precision as a user writes it by hand: the model
    in the compute dtype, fp32 master weights that the run's optimizers (AdamW, fused on
    CUDA; with `--optimizer muon`, torch.optim.Muon on the hidden matrices too) step, and
    the compute weights refreshed from them by one foreach copy. No hooks, no flat buffers.

    The like-for-like floor of zs1-zs3 at one GPU: the same fp32 optimizer work, so their
    gap to it is the engine's own overhead. fp32 gradients are made per step (one foreach
    copy from the compute-dtype ones) and dropped after the step, so they never coexist
    with the activations, as the sharded engines' fp32 gradient shards do not either.
    """
    # Deduplicated: a tied head is one parameter.
    weights: list[torch.Tensor] = list(model.parameters())
    masters: list[torch.Tensor] = [nn.Parameter(p.detach().clone()) for p in weights]
    opts = make_optimizers(model, s, masters)
    model.to(s.dtype)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        model(x, y).backward()
        grads = [p.grad for p in weights]
        if any(g is None for g in grads):
            raise RuntimeError("floor32: a parameter got no gradient")
        grads32 = [torch.empty_like(m) for m in masters]
        torch._foreach_copy_(grads32, grads)  # type: ignore[arg-type]  # None ruled out above
        for m, g in zip(masters, grads32, strict=True):
            m.grad = g
        model.zero_grad(set_to_none=True)  # the compute-dtype gradients are spent
        if s.clip > 0:
            torch.nn.utils.clip_grad_norm_(masters, s.clip)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_copy_(weights, masters)

    return step


def setup_floor32_adamw(model: nn.Module, s: Settings) -> Stepper:
    """`floor32` stepped by AdamW alone whatever `--optimizer` says: beside `floor32` in a
    Muon run, what Muon's step costs over AdamW's."""
    return setup_floor32(model, dataclasses.replace(s, optimizer="adamw"))


def compile_blocks(model: nn.Module) -> None:
    """Replace every block of `model.blocks` by `torch.compile(block, fullgraph=True)`."""
    blocks: Any = model.blocks
    for i, block in enumerate(blocks):
        blocks[i] = torch.compile(block, fullgraph=True)


def setup_floorc(model: nn.Module, s: Settings) -> Stepper:
    """The floor with every block under torch.compile: what the compiled engines (`zs3c`,
    `fsdp2c`) would run at best, so their ratio to it is the cost of sharding alone."""
    compile_blocks(model)
    return setup_floor(model, s)


def setup_floor32c(model: nn.Module, s: Settings) -> Stepper:
    """`floor32` with every block under torch.compile: the like-for-like floor of `zs3c`
    (the same fp32 optimizer work, inductor's kernels), so its gap to `floorc` is what the
    masters cost and zs3c's gap to it the engine's own."""
    compile_blocks(model)
    return setup_floor32(model, s)


def setup_floorw(model: nn.Module, s: Settings) -> Stepper:
    """The floor compiled whole (`torch.compile(model, fullgraph=True)`): every block is
    traced and lowered again, as zeroshard.compile's one graph is (its compile-time peer)."""
    compiled: Any = torch.compile(model, fullgraph=True)  # an nn.Module, typed as a callable
    return setup_floor(compiled, s)


def setup_floorr(model: nn.Module, s: Settings) -> Stepper:
    """`floorw` with every block's forward a `torch.compiler.nested_compile_region`: one
    graph for the model, in which identical blocks share one compiled body (inductor
    compiles it once). The regional compile zeroshard.compile would have to build on."""
    mark_block_regions(model)
    return setup_floorw(model, s)


def mark_block_regions(model: nn.Module) -> None:
    """Make every block of `model.blocks` run its `forward` as a nested compile region."""
    blocks: Any = model.blocks
    regions: dict[type, type] = {}
    for block in blocks:
        cls = type(block)
        if cls not in regions:
            # A subclass of our own whose `forward` is the region: replacing the class's
            # own would make every engine's blocks regions, and a region bound per instance
            # (`block.forward = ...`) gave the wrong blocks' weights to the examples' blocks
            # (torch 2.13, CPU).
            region = torch.compiler.nested_compile_region(cls.forward)
            regions[cls] = type(f"{cls.__name__}Region", (cls,), {"forward": region})
        block.__class__ = regions[cls]


def setup_floorr_memo(model: nn.Module, s: Settings) -> Stepper:
    """`floorr` with torch's invoke_subgraph schema memoized per region during each step.

    A diagnostic, not an engine a user has: torch 2.11-2.13 re-trace a region's body on
    every call in AOTAutograd (`InvokeSubgraphHOP.gen_schema`, from the autograd key's
    check for input mutation), so the compile time grows with the number of blocks even
    though inductor compiles one body. This engine shows what is left without that."""
    step = setup_floorr(model, s)

    def memo_step(x: torch.Tensor, y: torch.Tensor) -> None:
        with memoized_region_schemas():
            step(x, y)

    return memo_step


@contextlib.contextmanager
def memoized_region_schemas() -> Iterator[None]:
    """Within: `InvokeSubgraphHOP.gen_schema` computed once per (region, operands' shapes,
    dtypes and requires_grad). The memo lives for one `with`, i.e. one step, within which
    a region's identifier names one body (one Dynamo graph per step, fullgraph)."""
    from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP

    original: Any = InvokeSubgraphHOP.gen_schema
    memo: dict[tuple[Any, ...], Any] = {}

    def gen_schema(self: Any, subgraph: Any, identifier: str | None, *operands: Any) -> Any:
        if identifier is None:
            return original(self, subgraph, identifier, *operands)
        key = (identifier, *(_metadata(o) for o in operands))
        if key not in memo:
            memo[key] = original(self, subgraph, identifier, *operands)
        return memo[key]

    InvokeSubgraphHOP.gen_schema = gen_schema  # type: ignore[method-assign]
    try:
        yield
    finally:
        InvokeSubgraphHOP.gen_schema = original  # type: ignore[method-assign]


def _metadata(operand: Any) -> Any:
    """What a region's schema depends on, of one operand."""
    if isinstance(operand, torch.Tensor):
        return (tuple(operand.shape), operand.dtype, operand.requires_grad)
    return repr(operand)


def setup_ddp(model: nn.Module, s: Settings) -> Stepper:
    """torch DistributedDataParallel (default buckets) with autocast."""
    from torch.nn.parallel import DistributedDataParallel

    ids = [s.device.index] if s.device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=ids)
    return plain_step(ddp, make_optimizers(ddp, s), s, autocast=True)


def _fully_shard() -> tuple[Any, Any]:
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6 kept FSDP2 under _composable
        from torch.distributed._composable.fsdp import (  # type: ignore[attr-defined]
            MixedPrecisionPolicy,
            fully_shard,
        )
    return fully_shard, MixedPrecisionPolicy


def _setup_fsdp2(
    model: nn.Module,
    s: Settings,
    reshard_after_forward: bool,
    hybrid: bool = False,
    after_step: Callable[[], None] | None = None,
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
    return plain_step(model, make_optimizers(model, s), s, autocast=False, after_step=after_step)


def setup_fsdp2(model: nn.Module, s: Settings) -> Stepper:
    """FSDP2 fully_shard per block and root, bf16 params, fp32 reduce (ZeRO-3)."""
    return _setup_fsdp2(model, s, reshard_after_forward=True)


def setup_fsdp2_zero2(model: nn.Module, s: Settings) -> Stepper:
    """FSDP2 with reshard_after_forward=False: parameters stay gathered (ZeRO-2 analogue)."""
    return _setup_fsdp2(model, s, reshard_after_forward=False)


def setup_fsdp2_hybrid(model: nn.Module, s: Settings) -> Stepper:
    """FSDP2 HSDP: shard within `shard_group_size` ranks, replicate across the rest."""
    return _setup_fsdp2(model, s, reshard_after_forward=True, hybrid=True)


def setup_fsdp2c(model: nn.Module, s: Settings) -> Stepper:
    """FSDP2 as `fsdp2`, each block wrapped in torch.compile first (as torchtitan does):
    fully_shard then hooks the wrapper, so its gathers stay outside the compiled blocks."""
    compile_blocks(model)
    return _setup_fsdp2(model, s, reshard_after_forward=True)


def setup_fsdp2_fp8_gather(model: nn.Module, s: Settings) -> Stepper:
    """`fsdp2` whose fp8 weights (torchao's fp8 all-gather) take their scales after
    every step, in one all-reduce (`precompute_float8_dynamic_scale_for_fsdp`)."""
    from benchmarks.train_step._float8 import precompute_scales

    return _setup_fsdp2(model, s, reshard_after_forward=True, after_step=precompute_scales(model))


def setup_fsdp2c_fp8_gather(model: nn.Module, s: Settings) -> Stepper:
    """`fsdp2c` with torchao's fp8 all-gather, as `setup_fsdp2_fp8_gather`."""
    from benchmarks.train_step._float8 import precompute_scales

    after = precompute_scales(model)  # before compile_blocks wraps the blocks
    compile_blocks(model)
    return _setup_fsdp2(model, s, reshard_after_forward=True, after_step=after)
