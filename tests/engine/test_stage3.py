"""Stage 3 specifics: MoE with rank-dependent routing, live-memory bounds, divergent ranks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks, subtests, world_fits
from tests.engine._models import VOCAB, global_batches, loss_fn, make_model, make_optimizer
from zeroshard.engine.runtime._unit import UnitState


class Expert(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x))


class MoELayer(nn.Module):
    """Top-1 routing by a rule that depends on the data's source rank: each rank sends its
    tokens to different experts, so experts run on some ranks and not on others."""

    def __init__(self, d: int, experts: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList([Expert(d) for _ in range(experts)])

    def forward(self, x: torch.Tensor, tokens: torch.Tensor, route: int) -> torch.Tensor:
        choice = (tokens * 3 + route) % len(self.experts)
        out = torch.zeros_like(x)
        for e in torch.unique(choice).tolist():
            mask = choice == e
            out[mask] = self.experts[e](x[mask])
        return x + out


class MoEModel(nn.Module):
    def __init__(self, d: int = 12, experts: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.moe = MoELayer(d, experts)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, tokens: torch.Tensor, route: int) -> torch.Tensor:
        return self.head(self.moe(self.emb(tokens), tokens, route))


def _moe_loss(model: nn.Module, batch: torch.Tensor, route: int) -> torch.Tensor:
    logits = model(batch[..., :-1], route)
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), batch[..., 1:].reshape(-1))


def _moe(device: str) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = MoEModel().to(device)
    ref = copy.deepcopy(model).cpu()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    batches = global_batches(3, 1, world, 3)
    # Experts are units of their own, but the MoE layer is a leaf: one gather for all of
    # them, so ranks routing to different experts still issue the same collectives.
    cfg = {
        "stage": 3,
        "unit_modules": ["Expert"],
        "leaf_modules": ["MoELayer"],
        "min_unit_params": 1,
    }
    model, opt = zs.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cfg)
    for step in range(3):
        _moe_loss(model, batches[step, 0, rank].to(device), route=rank).backward()
        opt.step()
        opt.zero_grad()
        # The reference: the mean over ranks of each rank's loss, routed as that rank does.
        loss = sum(_moe_loss(ref, batches[step, 0, r], route=r) for r in range(world)) / world
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = zs.full_state_dict(model)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [2, 3])
def test_moe_rank_dependent_routing_matches_reference(world_size: int, device: str) -> None:
    world_fits(device, world_size)
    run_ranks(_moe, world_size, device, device=device)


class Deep(nn.Module):
    def __init__(self, widths: list[int]) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, w), nn.GELU(), nn.Linear(w, 16)) for w in widths
        )
        self.head = nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def _live_case(device: str, depth: int) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Deep([40, 72, 24, 56, 32]).to(device)
    cfg = {"stage": 3, "min_unit_params": 1, "persistence_threshold": 0, "prefetch_depth": depth}
    model, opt = zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    state = zs.engine_state(model)
    assert state.stage3 is not None
    units = state.stage3.units
    persistent = sum(u.nbytes for u in units if u.persistent)
    others = sorted((u.nbytes for u in units if not u.persistent), reverse=True)
    bound = persistent + sum(others[: depth + 1])
    batches = global_batches(3, 1, dist.get_world_size(), 2)
    stats = zs.engine_stats(model)
    trainable = sum(1 for u in units for g in u.groups if g.trainable)
    (last,) = [u for u in units if u.module is model.blocks[-1]]
    for step in range(3):
        stats.reset()
        loss = loss_fn(model, batches[step, 0, rank].to(device))
        # The life of each unit: after forward the persistent ones stay gathered, and
        # once the order is known (after the first step) the last unit of forward, which
        # backward needs first; after backward every group was reduce-scattered once and
        # the rest released.
        kept = [u for u in units if u.state is not UnitState.RELEASED and not u.persistent]
        assert kept == ([last] if step > 0 else []), (step, [u.label for u in kept])
        loss.backward()
        assert stats.reduce_scatters == trainable, (stats, trainable)
        assert all(u.persistent for u in units if u.state is not UnitState.RELEASED)
        # The root once, each other unit for forward and again for backward, but the kept
        # one once.
        others = sum(1 for u in units if not u.persistent)
        assert stats.gathers == 1 + 2 * others - int(step > 0), (step, stats)
        opt.step()
        opt.zero_grad()
        assert stats.peak_live_bytes <= bound, (depth, step, stats, bound)
        if step > 0 and depth > 0:
            assert stats.prefetches > 0, "after the first step the order is known: prefetch"
    assert stats.live_bytes == 0, "after a step nothing stays gathered"
    with torch.no_grad():
        loss_fn(model, batches[0, 0, rank].to(device))
    # No backward can follow a forward without autograd: the last unit is released.
    assert all(u.persistent for u in units if u.state is not UnitState.RELEASED)


def _profile_case(device: str) -> None:
    """Each phase of a step shows in a profile under its zeroshard:: label."""
    torch.manual_seed(0)
    model = Deep([8, 8]).to(device)
    cfg = {"stage": 3, "min_unit_params": 1, "persistence_threshold": 0}
    model, opt = zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    batches = global_batches(1, 1, dist.get_world_size(), 2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss_fn(model, batches[0, 0, dist.get_rank()].to(device)).backward()
        opt.step()
        opt.zero_grad()
    names = {e.name for e in prof.events()}
    phases = {"gather", "release", "reduce_scatter", "optimizer_step"}
    assert {f"zeroshard::{p}" for p in phases} <= names, sorted(names)


def _live(device: str) -> None:
    run_each(subtests({"depth": [0, 1, 2]}), lambda depth: _live_case(device, depth))
    _profile_case(device)


@pytest.mark.gpu
def test_live_bytes_bounded_by_prefetch_depth_and_phases_labelled(device: str) -> None:
    world_fits(device, 2)
    run_ranks(_live, 2, device, device=device)


class Skipper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = make_model(0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        model = self.inner
        if dist.get_rank() == 1:
            # This rank diverges: it skips the first block, the other rank does not.
            blocks = model.blocks
            model.blocks = nn.ModuleList([blocks[1]])
            try:
                return model(tokens)
            finally:
                model.blocks = blocks
        return model(tokens)


def _divergent(device: str) -> None:
    model = Skipper().to(device)
    cfg = {
        "stage": 3,
        "min_unit_params": 1,
        "persistence_threshold": 0,
        "collective_timeout_s": 60.0,
        "prefetch_depth": 0,
    }
    model, opt = zs.initialize(model, make_optimizer(model), cfg)
    tokens = global_batches(1, 1, 2, 2)[0, 0, dist.get_rank()].to(device)
    # Rank 1 skips blocks.0: each rank is told which unit it was gathering and which
    # (a check collective, not the timeout, detects it: the timeout is only a backstop)
    # unit the other rank was, before any mismatched gather runs.
    mine, theirs = ("blocks.0", "blocks.1") if dist.get_rank() == 0 else ("blocks.1", "blocks.0")
    with pytest.raises(
        zs.DivergentRanksError,
        match=rf"gathering unit \d \(inner\.{mine}\).*unit \d \(inner\.{theirs}\)",
    ):
        loss_fn(model, tokens).backward()
        opt.step()


def test_divergent_ranks_fail_with_a_named_error() -> None:
    run_ranks(_divergent, 2, "cpu", timeout_s=120)
