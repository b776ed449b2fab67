"""CPU offload: parity with the single-process reference, even chunks, pinned fallback.

Offload on must train exactly like offload off: the same plain fp32 reference as
test_parity.py, at its tolerances (fp32: rtol 1e-5 / atol 1e-6 on losses, norms and final
parameters; bf16: rtol 2e-2 on losses and norms, the total update within 10% in norm).
Gradient shards after zero_grad and one micro-step equal the reference's gradients
element by element (fp32 reduce: rtol 1e-5 / atol 1e-6; bf16 reduce: within 2% in norm
per group, the norm within rtol 1e-2).
On CPU ranks the offload path runs whole, its copies staying within host memory.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks, subtests, world_fits
from tests.engine._models import global_batches, loss_fn, make_model, make_optimizer, reference_run
from zeroshard.engine.runtime.offload._io import host_tensor
from zeroshard.engine.runtime.offload._plan import choose_offloaded

STEPS = 3
MICRO = 2


def _config(stage: int, dtype: str, **offload: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "stage": stage,
        "compute_dtype": dtype,
        "reduce_dtype": "fp32",
        "reduce_bucket_bytes": 1500,
        "max_inflight_reductions": 1,
        "offload_optimizer": True,
        # Small chunks: groups straddle chunk boundaries, as they do on a big model.
        "offload_chunk_bytes": 1000,
        **offload,
    }
    if stage == 3:
        cfg.update(min_unit_params=1, persistence_threshold=0)
    return cfg


def _fused(model: torch.nn.Module) -> torch.optim.Optimizer:
    """make_optimizer's AdamW with torch's fused kernel (what offload recommends on CPU)."""
    groups = make_optimizer(model).param_groups
    return torch.optim.AdamW(
        [{k: v for k, v in g.items() if k in ("params", "weight_decay")} for g in groups],
        lr=1e-3,
        betas=(0.9, 0.95),
        fused=True,
    )


def _parity_case(
    device: str, stage: int, dtype: str, accum: int, fused: bool = False, **offload: Any
) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model(seed=stage * 10 + accum).to(device)
    batches = global_batches(STEPS, accum, world, MICRO)
    ref_losses, ref_norms, ref_state = reference_run(model.cpu(), make_optimizer, batches, 0.5)
    model.to(device)
    initial = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    inner = _fused(model) if fused else make_optimizer(model)
    model, opt = zs.initialize(model, inner, _config(stage, dtype, **offload))
    offloaded = zs.engine_state(model).offload
    assert offloaded is not None
    held = [g for g in opt.flat_groups if offloaded.holds(g)]
    assert held
    ratio = offload.get("offload_ratio", 1.0)
    # Offloaded masters (and so their optimizer state) are host tensors; with a ratio the
    # rest stays where it was, on the device.
    moved = [g for g in opt.flat_groups if g.grads is offloaded.grads]
    assert moved == held and all(g.master.device.type == "cpu" for g in moved)
    groups = list(opt.flat_groups)
    if ratio == 1.0:
        assert moved == groups
    else:
        # The ratio is of the trainable elements; frozen groups, which have no optimizer
        # state, stay on the device. The groups backward completes first go to the host,
        # so the CPU starts stepping early and the last ones, the step's tail, step on the
        # device: a prefix of stage 1/2's trainable groups (gradient-ready order), a suffix
        # of stage 3's (registration order).
        trainable = [g for g in groups if g.trainable]
        assert len(trainable) < len(groups), "the model has no frozen group to keep"
        share = sum(g.layout.shard_numel for g in moved)
        total = sum(g.layout.shard_numel for g in trainable)
        assert ratio * total <= share < total, (share, total)
        n = len(moved)
        assert moved == (trainable[len(trainable) - n :] if stage == 3 else trainable[:n])
    # offload_params: the device keeps no copy of the offloaded compute shards.
    assert (offloaded.compute_dev is None) == offload.get("offload_params", False)
    tol = 1e-5 if dtype == "fp32" else 2e-2
    for step in range(STEPS):
        total_loss = torch.zeros(1, device=device)
        for a in range(accum):
            loss = loss_fn(model, batches[step, a, rank].to(device)) / accum
            loss.backward()
            total_loss += loss.detach()
        norm = opt.clip_grad_norm_(0.5)
        torch.testing.assert_close(float(norm), ref_norms[step], rtol=tol, atol=1e-6)
        opt.step()
        opt.zero_grad()
        for g in held:
            for value in opt.state[g.master].values():
                if value.dim():
                    assert value.device.type == "cpu", "offloaded optimizer state left the host"
        dist.all_reduce(total_loss)
        torch.testing.assert_close(float(total_loss) / world, ref_losses[step], rtol=tol, atol=1e-6)
    full = zs.full_state_dict(model)
    if dtype == "fp32":
        for name, ref in ref_state.items():
            torch.testing.assert_close(full[name], ref, rtol=1e-5, atol=1e-6, msg=name)
    else:
        keys = [k for k in initial if k not in ("frozen.weight", "frozen.bias", "offset")]
        ours = torch.cat([(full[k] - initial[k]).reshape(-1) for k in keys])
        theirs = torch.cat([(ref_state[k] - initial[k]).reshape(-1) for k in keys])
        err = float((ours - theirs).norm() / theirs.norm())
        assert err < 0.10, f"the update differs from the reference's by {err:.1%}"


def test_choose_offloaded_takes_the_groups_backward_completes_first() -> None:
    every = [True] * 4
    assert choose_offloaded([1, 2, 3, 4], every, 0.5, registration_order=False) == [0, 1, 2]
    assert choose_offloaded([1, 2, 3, 4], every, 0.5, registration_order=True) == [2, 3]
    assert choose_offloaded([4, 1, 1], every[:3], 0.5, registration_order=False) == [0]
    assert choose_offloaded([5, 5, 5], every[:3], 1.0, registration_order=True) == [0, 1, 2]


def test_choose_offloaded_counts_trainable_groups_only() -> None:
    # A large frozen group neither takes the CPU's share nor goes to the host below 1.
    frozen_first = [False, True, True, True]
    assert choose_offloaded([90, 2, 2, 2], frozen_first, 0.5, registration_order=False) == [1, 2]
    assert choose_offloaded([90, 2, 2, 2], frozen_first, 0.5, registration_order=True) == [2, 3]
    # At 1 everything goes, frozen masters too (as with no ratio at all).
    assert choose_offloaded([90, 2], [False, True], 1.0, registration_order=False) == [0, 1]
    assert choose_offloaded([3, 3], [False, False], 0.5, registration_order=False) == []


def _parity(device: str) -> None:
    cases = subtests({"stage": [1, 2, 3], "dtype": ["fp32", "bf16"], "accum": [2]})
    cases += [{"stage": s, "dtype": "fp32", "accum": 1, "offload_ratio": 0.5} for s in (1, 2, 3)]
    cases += [
        {"stage": 3, "dtype": d, "accum": 2, "offload_params": True} for d in ("fp32", "bf16")
    ]
    cases += [{"stage": s, "dtype": "fp32", "accum": 1, "fused": True} for s in (2, 3)]
    # Three micro-steps: the first overwrites the host gradient, the next two are staged
    # and added on the worker thread; bf16 reduce also upcasts on the device first.
    cases += [{"stage": s, "dtype": "fp32", "accum": 3} for s in (1, 2, 3)]
    cases.append({"stage": 2, "dtype": "bf16", "accum": 3, "reduce_dtype": "bf16"})
    run_each(cases, lambda **c: _parity_case(device, **c))


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2])
def test_offload_parity(world_size: int, device: str) -> None:
    world_fits(device, world_size)
    run_ranks(_parity, world_size, device, device=device)


def _parity_world3(device: str) -> None:
    cases = [{"stage": s, "dtype": "fp32", "accum": 1} for s in (1, 2, 3)]
    cases.append({"stage": 3, "dtype": "fp32", "accum": 1, "offload_params": True})
    run_each(cases, lambda **c: _parity_case(device, **c))


@pytest.mark.gpu
def test_offload_parity_world3(device: str) -> None:
    world_fits(device, 3)
    run_ranks(_parity_world3, 3, device, device=device)


def _evenness(device: str) -> None:
    def case(stage: int, offload_params: bool = False, offload_ratio: float = 1.0) -> None:
        model = make_model(5).to(device)
        cfg = _config(stage, "bf16", offload_params=offload_params, offload_ratio=offload_ratio)
        model, opt = zs.initialize(model, make_optimizer(model), cfg)
        loss_fn(model, global_batches(1, 1, 1, 2)[0, 0, 0].to(device)).backward()
        opt.step()
        offloaded = zs.engine_state(model).offload
        assert offloaded is not None
        b = offloaded.nbytes()
        state = sum(
            t.nbytes
            for g in [g for g in opt.flat_groups if offloaded.holds(g)]
            for t in opt.state[g.master].values()
            if isinstance(t, torch.Tensor) and t.dim()
        )
        mine = torch.tensor(
            [b.chunks, b.host, b.pinned, b.device, b.h2d_per_step, state], device=device
        )
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        assert b.chunks > 1, "the test wants several chunks"
        # The bf16 gradients held until step() are pinned (gradients land in them by DMA)
        # where pinning works: on a GPU; CPU ranks pin nothing.
        held = offloaded.grads.held(next(g.index for g in opt.flat_groups if offloaded.holds(g)))
        grad = b.chunks * offloaded.layout.shard_numel * held.itemsize
        assert b.host >= 2 * grad, (b, grad)
        if device == "cuda":
            assert held.is_pinned() and b.pinned >= grad, (b, grad)
            # The masters go up to be cast on the device (not with offload_params).
            assert offloaded.master.is_pinned() == (offloaded.compute_dev is not None)
        else:
            assert b.pinned == 0, b
        for r, theirs in enumerate(every):
            assert torch.equal(theirs, mine), f"rank {r} holds {theirs.tolist()}, I {mine.tolist()}"

    cases = [
        {"stage": 1},
        {"stage": 2},
        {"stage": 3},
        {"stage": 3, "offload_params": True},
        {"stage": 2, "offload_ratio": 0.5},
    ]
    run_each(cases, case)


@pytest.mark.gpu
def test_chunk_evenness(device: str) -> None:
    world_fits(device, 3)
    run_ranks(_evenness, 3, device, device=device)


def _grads_case(device: str, stage: int, set_to_none: bool, reduce_dtype: str = "fp32") -> None:
    """After a step of 3 micro-steps, zero_grad and one micro-step: every gradient shard is
    the reference's gradient of that micro-batch (nothing stale from the step before)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model(seed=7 + stage).to(device)
    batches = global_batches(2, 3, world, MICRO)
    _, _, ref_state = reference_run(model.cpu(), make_optimizer, batches[:1], None)
    ref = copy.deepcopy(model)
    ref.load_state_dict(ref_state)
    loss_fn(ref, batches[1, 0].reshape(-1, batches.shape[-1])).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    ref_norm = torch.cat([t.reshape(-1) for t in ref_grads.values()]).norm()
    model.to(device)
    cfg = _config(stage, "fp32", reduce_dtype=reduce_dtype)
    model, opt = zs.initialize(model, make_optimizer(model), cfg)
    for a in range(3):
        (loss_fn(model, batches[0, a, rank].to(device)) / 3).backward()
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)
    loss_fn(model, batches[1, 0, rank].to(device)).backward()
    # An infinite max_norm scales by exactly 1: this only reduces (stage 1) and measures.
    norm = opt.clip_grad_norm_(float("inf"))
    rtol = 1e-5 if reduce_dtype == "fp32" else 1e-2
    torch.testing.assert_close(float(norm), float(ref_norm), rtol=rtol, atol=1e-6)
    host = zs.engine_state(model).offload
    for g in opt.flat_groups:
        if not g.trainable:
            continue
        expected = torch.zeros(g.layout.padded_numel)
        for slot in g.layout.slots:
            expected[slot.offset : slot.end] = ref_grads[slot.name].reshape(-1)
        lo, hi = g.shard_range
        # Offloaded: the host gradient in the reduce dtype (master.grad is set in the step).
        grad = g.grad_shard if host is not None and host.holds(g) else g.master.grad
        assert grad is not None, f"group {g.index} has no gradient"
        got, want = grad.float().cpu(), expected[lo:hi]
        if reduce_dtype == "fp32":
            torch.testing.assert_close(
                got, want, rtol=1e-5, atol=1e-6, msg=lambda m, i=g.index: f"group {i}: {m}"
            )
        else:
            err = float((got - want).norm() / want.norm())
            assert err < 2e-2, f"group {g.index}: gradient off by {err:.2%} in norm"


def _grads(device: str) -> None:
    cases = subtests({"stage": [1, 2, 3], "set_to_none": [True, False]})
    cases.append({"stage": 2, "set_to_none": True, "reduce_dtype": "bf16"})
    run_each(cases, lambda **c: _grads_case(device, **c))


@pytest.mark.gpu
def test_grads_after_zero_grad_match_reference(device: str) -> None:
    world_fits(device, 2)
    run_ranks(_grads, 2, device, device=device)


def _checkpoint(root: str, device: str) -> None:
    def case(stage: int) -> None:
        path = f"{root}/stage{stage}"
        rank, world = dist.get_rank(), dist.get_world_size()
        model = make_model(11).to(device)
        model, opt = zs.initialize(model, make_optimizer(model), _config(stage, "fp32"))
        batches = global_batches(4, 1, world, 2)

        def train(step: int) -> None:
            loss_fn(model, batches[step, 0, rank].to(device)).backward()
            opt.step()
            opt.zero_grad()

        train(0)
        zs.save_checkpoint(model, opt, path, step=1)
        train(1)
        after = zs.full_state_dict(model)
        train(2)
        assert zs.load_checkpoint(model, opt, path) == 1
        train(1)
        again = zs.full_state_dict(model)
        for k in after:
            assert torch.equal(after[k], again[k]), f"{k} differs after resuming with offload"
        # The same checkpoint resumes without offload, to the same values.
        plain = make_model(11).to(device)
        cfg = _config(stage, "fp32", offload_optimizer=False)
        plain, plain_opt = zs.initialize(plain, make_optimizer(plain), cfg)
        zs.load_checkpoint(plain, plain_opt, path)
        loss_fn(plain, batches[1, 0, rank].to(device)).backward()
        plain_opt.step()
        other = zs.full_state_dict(plain)
        for k in after:
            torch.testing.assert_close(other[k], after[k], rtol=1e-6, atol=1e-7, msg=k)
        # Full weights loaded into an offloaded model reach the host masters and the
        # compute shards: the model computes exactly what the plain one does.
        if rank == 0:
            save_file({k: v.clone() for k, v in after.items()}, f"{path}/full.safetensors")
        dist.barrier()
        fresh = make_model(3).to(device)
        fresh, _ = zs.initialize(fresh, make_optimizer(fresh), _config(stage, "fp32"))
        zs.load_safetensors(fresh, f"{path}/full.safetensors")
        tokens = batches[3, 0, rank].to(device)
        with torch.no_grad():
            torch.testing.assert_close(loss_fn(fresh, tokens), loss_fn(plain, tokens))

    run_each(subtests({"stage": [1, 2, 3]}), case)


@pytest.mark.gpu
def test_offload_checkpoint_round_trip(tmp_path: Path, device: str) -> None:
    world_fits(device, 2)
    run_ranks(_checkpoint, 2, str(tmp_path), device, device=device)


def test_pinned_memory_fallback_warns_once() -> None:
    if torch.cuda.is_available():
        t, pinned = host_tensor(8, torch.float32, pin=True)
        assert pinned and t.is_pinned()
        return
    # Without CUDA torch cannot pin: the real allocation fails and falls back to pageable.
    with pytest.warns(RuntimeWarning, match="pageable"):
        t, pinned = host_tensor(8, torch.float32, pin=True)
    assert not pinned and t.shape == (8,) and not t.any()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, pinned = host_tensor(8, torch.bfloat16, pin=True)
    assert not pinned


def test_offload_config_and_deepspeed_forms() -> None:
    cfg = zs.ZeroConfig.from_dict(
        {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": False, "ratio": 0.5},
            "offload_param": {"device": "cpu", "pin_memory": False},
        }
    )
    assert cfg.offload.optimizer and cfg.offload.params and cfg.offload.ratio == 0.5
    assert not cfg.offload.pin_memory
    off = zs.ZeroConfig.from_dict({"stage": 2, "offload_optimizer": {"device": "none"}})
    assert not off.offload.optimizer
    bad: list[tuple[dict[str, Any], str]] = [
        ({"offload_optimizer": {"device": "nvme"}}, "nvme.*not supported"),
        ({"offload_optimizer": {"device": "cpu", "buffer_size": 1}}, "valid: .*ratio"),
        ({"stage": 2, "offload_param": {"device": "cpu"}}, "needs offload.optimizer"),
        (
            {
                "stage": 2,
                "offload_optimizer": {"device": "cpu"},
                "offload_param": {"device": "cpu"},
            },
            "needs stage 3",
        ),
        ({"stage": 2, "offload_params": True, "offload_optimizer": True}, "needs stage 3"),
        ({"stage": 3, "offload_params": True}, "needs offload.optimizer"),
        ({"offload_ratio": 0.5}, "needs offload.optimizer"),
        (
            {"offload_optimizer": True, "offload_ratio": 1.5},
            r"offload.ratio \(offload_ratio\) must be in \(0, 1\]",
        ),
        ({"offload_optimizer": True, "offload_chunk_bytes": 0}, "positive int"),
    ]
    for d, match in bad:
        with pytest.raises(ValueError, match=match):
            zs.ZeroConfig.from_dict(d)
