"""offload.compiled_step: Adam/AdamW in one inductor-compiled pass per chunk.

Its arithmetic is torch's but not its bits ([Note: compiled host step]): the kernel
alone against torch's fused kernel agrees to a few last bits; against the default
offload step (bit for bit torch's, test_offload_blocked.py) masters and optimizer state
agree to rtol 1e-5 (atol 1e-6 after 3 steps with fp32 compute, 1e-7 after one with
bf16 or fp16: see `_close_case`), at stages 1-3 with gradient accumulation, clipping, fp16
loss scaling, fp32 gradients, a share offloaded, offload_params and the step inside
backward; for Adam and AdamW with amsgrad, maximize and a tensor lr. Stepping inside
backward gives the serial compiled step's bits. An optimizer it cannot compile is
refused at initialize.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks, world_fits
from tests.engine.test_offload_blocked import Wide, _optimizer, _train
from zeroshard.engine.runtime._host_adam import FusedAdam
from zeroshard.engine.runtime._host_kernel import _kernel, coefficients, scale_of, step_piece

LR, STEPS = 1e-3, 3  # test_offload_blocked's optimizer and loop


def _agree(ours: torch.Tensor, ref: torch.Tensor, what: str, atol: float) -> None:
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=atol, msg=lambda m: f"{what}: {m}")


def _close_case(device: str, stage: int, dtype: str = "bf16", accum: int = 1, **kw: Any) -> None:
    # bf16/fp16 compute: one step. After it a last-bit difference in a master may flip its
    # compute-dtype rounding, the next gradients differ in their last bits too, and Adam
    # turns that into whole steps for elements whose gradient is near 0 (measured here:
    # 1e-8 of the weights in norm after one step, 1e-4 after two, in either dtype).
    kw["steps"] = STEPS if dtype == "fp32" else 1
    # Three fp32 steps: test_parity's fp32 tolerance (an element or two of a million
    # moves 2e-7 by then); one step: a few last bits.
    atol = 1e-6 if dtype == "fp32" else 1e-7
    _kernel.cache_clear()
    ours, ours_state = _train(device, stage, dtype, accum, offload=True, compiled=True, **kw)
    assert _kernel.cache_info().currsize > 0, "the compiled step did not run"
    ref, ref_state = _train(device, stage, dtype, accum, offload=True, **kw)
    if kw.get("early"):
        # The serial compiled step, bit for bit.
        serial_kw = {k: v for k, v in kw.items() if k != "early"}
        serial, _ = _train(device, stage, dtype, accum, offload=True, compiled=True, **serial_kw)
        for name, want in serial.items():
            assert torch.equal(ours[name], want), f"{name}: step_in_backward != serial"
    for name, want in ref.items():
        _agree(ours[name], want, name, atol)
    for i, (a, b) in enumerate(zip(ours_state, ref_state, strict=True)):
        assert a.keys() == b.keys(), (i, a.keys(), b.keys())
        for k in b:
            if b[k].dim():
                _agree(a[k], b[k], f"{k} of group {i}", atol)
            else:
                assert torch.equal(a[k], b[k]), f"{k} of group {i}"


def _close(device: str) -> None:
    cases: list[dict[str, Any]] = [
        {"stage": s, "dtype": "fp32", "accum": a} for s, a in ((1, 2), (2, 1), (3, 2))
    ]
    cases += [
        {"stage": 3, "accum": 2, "clip": 0.05},
        {"stage": 2, "dtype": "fp16", "clip": 0.05},
        {"stage": 2, "dtype": "fp32", "accum": 2, "clip": 0.05},
        {"stage": 2, "accum": 2, "early": True},
        {"stage": 3, "early": True, "params": True},
        {"stage": 2, "dtype": "fp32", "clip": 0.05, "ratio": 0.5},
    ]
    kinds = ("adam", "amsgrad", "maximize", "lr-tensor")
    cases += [{"stage": 2, "dtype": "fp32", "accum": 2, "kind": k, "clip": 0.05} for k in kinds]
    run_each(cases, lambda **c: _close_case(device, **c))


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2])
def test_compiled_step_matches_torchs_step(world_size: int, device: str) -> None:
    world_fits(device, world_size)
    run_ranks(_close, world_size, device, device=device, timeout_s=900.0)


def _refuses(device: str) -> None:
    model = Wide().to(device)
    cfg = {"stage": 2, "offload_optimizer": True, "offload_compiled_step": True}
    with pytest.raises(ValueError, match=r"offload\.compiled_step.*fused=True"):
        zs.initialize(model, _optimizer(model, "adamw", own=True), cfg)
    unfused = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=False)
    with pytest.raises(ValueError, match=r"offload\.compiled_step.*fused=True"):
        zs.initialize(model, unfused, cfg)


def test_compiled_step_refuses_what_it_cannot_compile() -> None:
    run_ranks(_refuses, 1, "cpu", device="cpu")
    with pytest.raises(ValueError, match=r"needs offload\.optimizer=True"):
        zs.ZeroConfig.from_dict({"offload_compiled_step": True})


@pytest.mark.parametrize("kind", ["adamw", "adam", "amsgrad", "maximize"])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_is_torchs_step_to_the_last_bits(kind: str, grad_dtype: torch.dtype) -> None:
    """Three steps on gradients over ten decades, with a clipping-like factor: the master
    and moments within a few last bits of torch's fused kernel, the cast out the master's."""
    torch.manual_seed(0)
    n = 4099  # not a multiple of any vector width
    fused = torch._fused_adam_ if kind == "adam" else torch._fused_adamw_
    adam = FusedAdam(fused, LR, 0.9, 0.95, 0.1, 1e-8, kind == "amsgrad", kind == "maximize")
    ref = [torch.randn(n) * 0.05, torch.zeros(n), torch.zeros(n), torch.zeros(n)]
    ours = [t.clone() for t in ref]
    out = torch.empty(n, dtype=torch.bfloat16)
    step = torch.zeros(())
    for k in range(1, 4):
        grad = (torch.randn(n) * torch.logspace(-10, 0, n)).to(grad_dtype)
        factor = torch.tensor(0.37)
        step += 1
        fused(
            [ref[0]],
            [grad.float() * factor],
            [ref[1]],
            [ref[2]],
            [ref[3]] if adam.amsgrad else [],
            [step],
            **adam.options,
        )
        moments = ours[1:4] if adam.amsgrad else ours[1:3]
        step_piece(
            adam, coefficients(adam, float(k)), scale_of([factor]), ours[0], grad, moments, out
        )
        # The gradient the moments see (Adam's adds weight_decay * master).
        g = grad.float().abs() * factor + adam.weight_decay * ref[0].abs()
        # A few last bits of the terms each value is made of (the update's ~lr for the
        # master, this gradient's for the moments), wherever they cancel or not.
        terms = (torch.full_like(g, LR), g, g * g, g * g)
        for name, a, b, t in zip(
            ("master", "exp_avg", "exp_avg_sq", "max"), ours, ref, terms, strict=True
        ):
            bound = 4 * torch.finfo(torch.float32).eps * (b.abs() + t)
            assert bool(((a - b).abs() <= bound).all()), f"step {k} {name}"
        assert torch.equal(out, ours[0].to(torch.bfloat16))
