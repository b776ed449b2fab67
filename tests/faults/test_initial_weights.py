"""Ranks that start with different weights all train rank 0's: `initialize` broadcasts
every parameter and buffer from the first rank of its replicas, at every stage, under
hybrid sharding, and after a meta-device init at stage 3 (experts: their own group's
first rank, in tests/engine/test_expert_groups.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks, subtests, world_fits
from tests.engine._models import make_model, make_optimizer
from tests.faults._engine import TIMEOUT_S, train_step


def _config(stage: int, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"stage": stage, "collective_timeout_s": TIMEOUT_S, **extra}
    if stage == 3:
        cfg.update(min_unit_params=1, persistence_threshold=0)
    return cfg


def _rank0_model() -> nn.Module:
    """What rank 0 holds before initialize in every case: seed 0, its own buffer."""
    return make_model(0)


def _start(stage: int, how: str, hybrid: bool, device: str) -> None:
    rank = dist.get_rank()
    if how == "seeded per rank":
        model = make_model(rank).to(device)
    else:  # the habit: every rank builds a model, rank 0 loads the pretrained weights
        model = make_model(100 + rank).to(device)
        if rank == 0:
            model.load_state_dict(_rank0_model().state_dict())
    with torch.no_grad():
        model.offset.add_(rank)  # a buffer that differs too
    cfg = _config(stage, **({"shard_group_size": 1} if hybrid else {}))
    model, opt = zs.initialize(model, make_optimizer(model), cfg)
    want = _rank0_model().state_dict()
    full = zs.full_state_dict(model)
    for name, value in want.items():
        assert torch.equal(full[name].cpu(), value), name
    assert torch.equal(model.offset.cpu(), want["offset"])
    if stage < 3:  # parameters are whole on every rank: each replica is rank 0's
        for name, p in model.named_parameters():
            assert torch.equal(p.detach().cpu(), want[name]), name
    # And the ranks stay one model: a step leaves every replica equal.
    train_step(model, opt, 0)
    mine = {k: v.cpu() for k, v in zs.full_state_dict(model).items()}
    everyone: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    assert all(all(torch.equal(o[k], v) for k, v in mine.items()) for o in everyone if o)


def _meta_init_with_per_rank_seeds(device: str) -> None:
    """Stage 3 on the meta device, the ranks' generators seeded differently beforehand:
    every unit is drawn alike on every rank; the real buffer comes from rank 0."""
    rank = dist.get_rank()
    with torch.device("meta"):
        model = make_model(0)
    model.register_buffer("offset", torch.full((13,), float(rank), device=device))
    names = {id(m): n for n, m in model.named_modules()}
    drawn: dict[str, torch.Tensor] = {}

    def init(module: nn.Module) -> None:
        for pname, p in module.named_parameters(recurse=False):
            nn.init.normal_(p, std=0.02)  # torch's generator, as reset_parameters() uses
            prefix = names[id(module)]
            drawn[f"{prefix}.{pname}" if prefix else pname] = p.detach().cpu()

    torch.manual_seed(1000 + rank)
    model, _ = zs.initialize(model, make_optimizer(model), _config(3), param_init=init)
    everyone: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, drawn)
    first = everyone[0]
    assert first is not None and first.keys() == drawn.keys()
    assert all(torch.equal(first[k], v) for k, v in drawn.items())
    full = {k: v.cpu() for k, v in zs.full_state_dict(model).items()}
    assert torch.equal(full["offset"], torch.zeros(13))
    assert torch.equal(model.offset.cpu(), full["offset"])
    # The tied embedding and head are one tensor, drawn twice: the later draw stands.
    assert torch.equal(full["emb.weight"], drawn["head.weight"])
    for name, value in drawn.items():
        if name not in ("emb.weight", "head.weight"):
            assert torch.equal(full[name], value), name


def _meta_on_some_ranks(device: str) -> None:
    """Rank 0 real, rank 1 on the meta device: one clear error on both, not a mix."""
    if dist.get_rank() == 0:
        model = make_model(0).to(device)
    else:
        with torch.device("meta"):
            model = make_model(0)
        model.register_buffer("offset", torch.zeros(13, device=device))
    with pytest.raises(ValueError, match=r"ranks disagree at initialize on parameter 0.*meta"):
        zs.initialize(model, make_optimizer(model), _config(3))


def _initial_weights(device: str) -> None:
    bodies = {
        "start": _start,
        "meta, per-rank seeds": _meta_init_with_per_rank_seeds,
        "meta on some ranks": _meta_on_some_ranks,
    }
    starts = subtests({"stage": [1, 2, 3], "how": ["seeded per rank", "pretrained on rank 0"]})
    starts.append({"stage": 2, "how": "seeded per rank", "hybrid": True})
    cases = [{"body": "start", "hybrid": False, **c} for c in starts]
    cases += [{"body": "meta, per-rank seeds"}, {"body": "meta on some ranks"}]
    cases = [dict(c, device=device) for c in cases]

    def run(body: str, **kwargs: Any) -> None:
        try:
            bodies[body](**kwargs)
        except pytest.fail.Exception as e:  # reported with the others, not past them
            raise AssertionError(str(e)) from None

    run_each(cases, run)


@pytest.mark.gpu
def test_ranks_start_from_rank0_weights(device: str) -> None:
    """Stages 1-3, each rank seeded differently or pretrained weights loaded on rank 0
    only, a buffer differing too, and hybrid sharding: every rank holds rank 0's
    weights and buffers after initialize, and stays equal after a step. Meta init at
    stage 3 after per-rank seeding draws alike everywhere; meta on some ranks only is
    refused on every rank."""
    world_fits(device, 2)
    run_ranks(_initial_weights, 2, device, device=device, timeout_s=240)
