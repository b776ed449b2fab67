"""Muon with `offload_optimizer` steps as Muon on the device does, on the device the test
runs on (`--device cuda -m gpu`: the pinned uploads, the batched downloads and the events
of [Note: Muon's host transfers] in runtime/whole/_muon.py, which a CPU run skips).

One rank, torch's recipe (Muon on the hidden matrices, AdamW on the rest), stages 2 and 3:
the offloaded run against the same run with everything on the device. The momentum and
AdamW's moments are stepped by the host's kernels in one and the device's in the other,
so on CUDA they agree to fp32 rounding (rtol 1e-5 / atol 1e-6, as test_parity.py); on
the CPU both are the same kernels and must agree bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks
from tests.engine._models import global_batches, loss_fn, make_model, muon_and_adamw

STEPS = 3
MICRO = 2


def _trained(
    base: torch.nn.Module, stage: int, offload: bool, device: str
) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(base).to(device)
    config = {"stage": stage, "offload_optimizer": offload}
    model, opt = zs.initialize(model, muon_and_adamw(model), config)
    if offload:
        on_host = [g for g in opt.flat_groups if g.home.kind is zs.HomeKind.HOST]
        assert on_host and all(g.master.device.type == "cpu" for g in on_host)
    for step in global_batches(STEPS, 1, 1, MICRO):
        loss_fn(model, step.reshape(-1, step.shape[-1]).to(device)).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().cpu() for k, v in zs.full_state_dict(model).items()}


def _case(device: str, stage: int) -> None:
    base = make_model(seed=20 + stage)
    on_device = _trained(base, stage, False, device)
    offloaded = _trained(base, stage, True, device)
    for name, want in on_device.items():
        if device == "cpu":
            assert torch.equal(offloaded[name], want), name
        else:
            torch.testing.assert_close(offloaded[name], want, rtol=1e-5, atol=1e-6, msg=name)


def _both(device: str) -> None:
    run_each([dict(stage=s) for s in (2, 3)], lambda **c: _case(device, **c))


@pytest.mark.gpu
def test_muon_offload_steps_as_on_the_device(device: str) -> None:
    run_ranks(_both, 1, device, device=device)
