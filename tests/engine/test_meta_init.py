"""Partitioned init: a meta-device model materialized one stage-3 unit at a time."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard.engine as zs
from tests._dist import run_ranks, world_fits
from tests.engine._models import global_batches, loss_fn, make_model, make_optimizer


def _fill(name: str, p: torch.Tensor) -> None:
    """A value for every element that depends only on the parameter's name and index.

    Computed on the CPU whatever the parameter's device: CUDA's sin may differ from the
    CPU's in the last bit, and the reference is built on the CPU.
    """
    salt = sum(ord(c) for c in name) % 97
    values = torch.arange(p.numel(), dtype=torch.float32)
    p.copy_((torch.sin(values * 0.37 + salt).reshape(p.shape) * 0.1).to(p.device))


def _meta_init(device: str) -> None:
    cpu_model = make_model(0)
    full = sum(p.numel() for p in cpu_model.parameters())
    with torch.device("meta"):
        model = make_model(0)
    names = {id(m): n for n, m in model.named_modules()}
    biggest_unit = 0
    live_at_init: list[int] = []

    def init(module: nn.Module) -> None:
        # Elements held in full right now: this unit's parameters and nothing else.
        live_at_init.append(sum(p.numel() for p in model.parameters() if not p.is_meta))
        for pname, p in module.named_parameters(recurse=False):
            prefix = names[id(module)]
            _fill(f"{prefix}.{pname}" if prefix else pname, p)

    cfg = {"stage": 3, "min_unit_params": 1, "persistence_threshold": 0}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match=r"buffers \['offset'\] are on the meta device"):
        zs.initialize(model, opt, cfg, param_init=init)
    # Buffers are the user's to materialize (they are small and rarely sharded).
    model.register_buffer("offset", cpu_model.offset.clone().to(device))
    model, zopt = zs.initialize(model, opt, cfg, param_init=init)
    state = zs.engine_state(model)
    assert state.stage3 is not None
    biggest_unit = max(sum(g.layout.numel for g in u.groups) for u in state.stage3.units)
    # The per-rank limit this test sets is one unit, less than the whole model.
    assert biggest_unit < full
    assert max(live_at_init) <= biggest_unit, (live_at_init, biggest_unit, full)

    with torch.no_grad():
        for name, p in cpu_model.named_parameters(remove_duplicate=False):
            _fill(name, p)
    # Tied weights: the head's init ran last on the shared tensor, as on the meta model.
    cpu_model.emb.weight.data = cpu_model.head.weight.data
    ours = zs.full_state_dict(model)
    for name, value in cpu_model.state_dict().items():
        assert torch.equal(ours[name], value), name
    # And it trains.
    tokens = global_batches(1, 1, dist.get_world_size(), 2)[0, 0, dist.get_rank()].to(device)
    loss_fn(model, tokens).backward()
    zopt.step()


@pytest.mark.gpu
def test_meta_model_materializes_one_unit_at_a_time(device: str) -> None:
    world_fits(device, 2)
    run_ranks(_meta_init, 2, device, device=device)


def _meta_needs_stage3() -> None:
    with torch.device("meta"):
        model = make_model(0)
    with pytest.raises(ValueError, match="needs stage 3"):
        zs.initialize(model, make_optimizer(model), {"stage": 2})


def test_meta_model_needs_stage3() -> None:
    run_ranks(_meta_needs_stage3, 1)
