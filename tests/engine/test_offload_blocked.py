"""The blocked host step: torch's fused Adam/AdamW over offloaded groups, block by block.

Groups here are past one step block (`STEP_BLOCK`, 1M elements), with a tail block
shorter than it, and blocks and groups straddle upload chunks. Bit for bit, offload on
trains like offload off (on the CPU: torch's fused step over whole fp32 gradient shards;
on a GPU: the serial CPU step of every group at once, an optimizer outside the pipeline):
the same weights and optimizer state after several steps, at stages 1-3, with gradient
accumulation, clipping, fp16 loss scaling, fp32 gradients, a share offloaded,
offload_params and the step inside backward; for Adam and AdamW with every
hyperparameter their fused kernel takes. The host holds one block's fp32 upcast, not one
group's (as the planner counts), and the upload gives every chunk the masters' cast
whatever order the ranges are written in.
"""

from __future__ import annotations

import copy
import os
import random
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks, world_fits
from tests.engine._models import VOCAB, global_batches, loss_fn
from tests.engine._offload_train import train_and_collect
from zeroshard.engine.planner._estimate import estimate
from zeroshard.engine.runtime.offload._fused_adam import STEP_BLOCK
from zeroshard.engine.runtime.offload._upload import ShardUpload

STEPS = 3
MICRO = 2


class Wide(nn.Module):
    """Odd sizes, weights past one step block, a frozen layer and bias vectors."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 1031)
        self.up = nn.Linear(1031, 1201)
        self.frozen = nn.Linear(1201, 97)
        self.frozen.requires_grad_(False)
        self.mid = nn.Linear(97, 1201)
        self.down = nn.Linear(1201, 1031)
        self.head = nn.Linear(1031, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.up(self.emb(idx)))
        h = h + self.mid(torch.tanh(self.frozen(h)))
        return self.head(self.down(h))


def _optimizer(model: nn.Module, kind: str, own: bool = False) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    kw: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.95), "fused": True}
    cls: type[torch.optim.Optimizer] = torch.optim.AdamW
    if kind == "adam":
        cls = torch.optim.Adam
    elif kind == "amsgrad":
        kw["amsgrad"] = True
    elif kind == "maximize":
        kw["maximize"] = True
    elif kind == "lr-tensor":
        kw["lr"] = torch.tensor(1e-3)
    if own:
        # An optimizer the pipeline does not know: one step over every group, unblocked.
        cls = type("OwnAdam", (cls,), {})
    return cls(groups, **kw)


def _train(
    device: str,
    stage: int,
    dtype: str,
    accum: int,
    *,
    offload: bool,
    kind: str = "adamw",
    own: bool = False,
    clip: float | None = None,
    early: bool = False,
    ratio: float = 1.0,
    params: bool = False,
    compiled: bool = False,
    steps: int = STEPS,
) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    torch.manual_seed(stage)
    model = Wide().to(device)
    cfg: dict[str, Any] = {
        "stage": stage,
        "compute_dtype": dtype,
        "reduce_bucket_bytes": 6 * 2**20,
        "offload_optimizer": offload,
    }
    if offload:
        # Chunks of 750K elements per rank: groups and blocks straddle them.
        cfg.update(offload_chunk_bytes=3 * 10**6, offload_ratio=ratio, offload_params=params)
        cfg.update(offload_compiled_step=compiled)
    if stage == 3:
        cfg.update(min_unit_params=1, persistence_threshold=0)
    model, opt = zs.initialize(model, _optimizer(model, kind, own), cfg)
    _, weights, state = train_and_collect(
        model, opt, steps=steps, accum=accum, micro=MICRO, device=device, early=early, clip=clip
    )
    return weights, state


def _same_case(device: str, stage: int, dtype: str = "bf16", accum: int = 1, **kw: Any) -> None:
    ours, ours_state = _train(device, stage, dtype, accum, offload=True, **kw)
    if device == "cpu":
        same = {k: v for k, v in kw.items() if k in ("kind", "clip")}
        ref, ref_state = _train(device, stage, dtype, accum, offload=False, **same)
    else:
        # The unblocked step of a subclass; step_in_backward refuses one, and its result is
        # the serial step's (tests/engine/test_offload_pipeline.py), so the reference is that.
        ref_kw = {k: v for k, v in kw.items() if k != "early"}
        ref, ref_state = _train(device, stage, dtype, accum, offload=True, **ref_kw, own=True)
    for name, want in ref.items():
        assert torch.equal(ours[name], want), f"{name} differs from the unblocked step"
    assert len(ours_state) == len(ref_state)
    for i, (a, b) in enumerate(zip(ours_state, ref_state, strict=True)):
        assert a.keys() == b.keys(), (i, a.keys(), b.keys())
        for k in b:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{k} of group {i}"


def _same(device: str) -> None:
    if device == "cuda":
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True, warn_only=True)
    cases: list[dict[str, Any]] = [{"stage": s, "accum": a} for s in (1, 2, 3) for a in (1, 2)]
    cases += [
        {"stage": 3, "accum": 2, "clip": 0.05},
        {"stage": 2, "dtype": "fp16", "clip": 0.05},
        {"stage": 2, "dtype": "fp32", "accum": 2, "clip": 0.05},
        {"stage": 2, "accum": 2, "early": True},
        {"stage": 3, "early": True, "params": True},
        {"stage": 2, "clip": 0.05, "ratio": 0.5},
        # A share offloaded under step_in_backward: the device steps the rest at step().
        {"stage": 2, "early": True, "ratio": 0.5},
    ]
    run_each(cases, lambda **c: _same_case(device, **c))


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2])
def test_blocked_step_is_bit_identical(world_size: int, device: str) -> None:
    world_fits(device, world_size)
    run_ranks(_same, world_size, device, device=device, timeout_s=600.0)


def _hyper(device: str) -> None:
    kinds = ["adam", "amsgrad", "maximize", "lr-tensor"]
    run_each(
        [{"kind": k} for k in kinds],
        lambda kind: _same_case(device, 2, "bf16", 2, kind=kind, clip=0.05),
    )


@pytest.mark.gpu
def test_blocked_step_hyperparameters(device: str) -> None:
    """Adam (L2 weight decay), amsgrad, maximize and a tensor lr, each bit for bit."""
    run_ranks(_hyper, 1, device, device=device, timeout_s=300.0)


def _host_bytes(device: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Wide().to(device)
    cfg = {"stage": 2, "compute_dtype": "bf16", "offload_optimizer": True}
    model, opt = zs.initialize(model, _optimizer(model, "adamw"), cfg)
    off = zs.engine_state(model).offload
    assert off is not None
    space = off.layout.num_chunks * off.layout.shard_numel
    biggest = max(g.layout.shard_numel for g in opt.flat_groups if off.holds(g))
    assert biggest > STEP_BLOCK, "the test needs a group past one block"
    # fp32 master per element (the bf16 gradients held until step() come with the first);
    # one block's fp32 upcast (the fallback would grow it to one group's); no staging slot
    # (no gradient passes through one without step_in_backward or accumulation).
    fixed = STEP_BLOCK * 4
    assert off.nbytes().host == space * 4 + fixed
    batches = global_batches(2, 1, world, MICRO)
    for step in range(2):
        loss_fn(model, batches[step, 0, rank].to(device)).backward()
        opt.clip_grad_norm_(0.05)
        opt.step()
        opt.zero_grad()
    assert off.nbytes().host == space * 6 + fixed, "the step upcast more than one block"
    # The planner counts the same bytes for this optimizer.
    with torch.device("meta"):
        meta = Wide()
    est = estimate(meta, cfg, world, MICRO, 7, optimizer=_optimizer(meta, "adamw"))
    moved = [g for g in opt.flat_groups if off.holds(g) and g.trainable]
    state = sum(t.nbytes for g in moved for t in opt.state[g.master].values() if t.dim())
    assert est.host == off.nbytes().host + state


@pytest.mark.gpu
def test_blocked_step_upcasts_one_block(device: str) -> None:
    run_ranks(_host_bytes, 1, device, device=device)


@pytest.mark.parametrize("offload_params", [False, True])
@pytest.mark.parametrize("mode", ["cast", "target"])
@pytest.mark.parametrize("order", ["ascending", "descending", "shuffled"])
def test_upload_casts_every_chunk(order: str, mode: str, offload_params: bool) -> None:
    """Ranges with gaps between them (left as they are) and a padded tail, written in
    pieces in any order, cast by the upload or (`target`, where there is one) by the
    writer as the compiled step does: each chunk's compute shard is the cast of its
    masters as soon as the last of its named pieces was written, on the device (where
    the masters go up in fp32) or on the host (offload_params)."""
    n, s = 7, 100
    master = torch.randn(n, s)

    def alloc(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype)

    used = n * s - 10  # the rest is padding: zeros in the masters
    master.view(-1)[used:] = 0
    up = ShardUpload(
        master,
        used,
        torch.device("cpu"),
        torch.bfloat16,
        pin=False,
        offload_params=offload_params,
        alloc=alloc,
    )
    compute = up.compute_host if offload_params else up.compute_dev
    assert compute is not None
    ranges = [(0, 130), (130, 345), (380, 560), (560, 690)]
    up.begin(ranges)
    pieces = [(lo, min(hi, lo + 40)) for a, hi in ranges for lo in range(a, hi, 40)]
    # Cut at chunks too: a target lies within one.
    pieces = [(max(lo, c), min(hi, c + s)) for lo, hi in pieces for c in range(0, n * s, s)]
    pieces = [(lo, hi) for lo, hi in pieces if lo < hi]
    if order == "descending":
        pieces.reverse()
    elif order == "shuffled":
        random.Random(0).shuffle(pieces)
    for k, (lo, hi) in enumerate(pieces):
        if mode == "target":
            out = up.target(lo, hi)
            assert (out is None) == (not offload_params), "a target only on the host"
            if out is not None:
                out.copy_(master.view(-1)[lo:hi])
            up.written(lo, hi, cast=False)
        else:
            # Every other piece names its masters' view, as the blocked step does.
            up.written(lo, hi, master.view(-1)[lo:hi] if k % 2 else None)
    # Every chunk the ranges touch went up with its last piece, before `finish`.
    assert torch.equal(compute, master.to(torch.bfloat16))
    up.finish()
    # A round that writes nothing (a refresh) casts every named chunk whole.
    master.mul_(3)
    up.begin([(0, n * s)])
    up.finish()
    assert torch.equal(compute, master.to(torch.bfloat16))


def _reloaded(device: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = global_batches(2, 1, world, MICRO)
    cfg = {"stage": 2, "compute_dtype": "bf16", "offload_optimizer": True}
    states = []
    for reload in (False, True):
        torch.manual_seed(0)
        model = Wide().to(device)
        model, opt = zs.initialize(model, _optimizer(model, "adamw"), cfg)
        off = zs.engine_state(model).offload
        assert off is not None
        for step in range(2):
            if reload and step == 1:
                # New state tensors, equal to the old: the views of the old are dropped
                # (not kept alive) and the next step steps the new ones.
                opt.load_state_dict(copy.deepcopy(opt.state_dict()))
                assert not off._blocked._views
            loss_fn(model, batches[step, 0, rank].to(device)).backward()
            opt.step()
            opt.zero_grad()
        states.append(
            [opt.inner.state[g.master] for g in opt.flat_groups if off.holds(g) and g.trainable]
        )
    for kept, loaded in zip(*states, strict=True):
        for k in kept:
            assert torch.equal(kept[k], loaded[k]), (k, kept[k], loaded[k])


def test_blocked_step_after_a_state_dict_load() -> None:
    """A loaded optimizer state is the one the blocked step steps from then on."""
    run_ranks(_reloaded, 1, "cpu")
