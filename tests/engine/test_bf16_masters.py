"""bf16 masters (`precision.master_dtype`): masters, gradient shards and optimizer state
in bf16, against a plain single-process bf16 run (every parameter bf16, the same AdamW).

One rank: bit for bit with the reference at stages 1-3, eager and compiled (the same
ops on the same bf16 values; no accumulation or clipping, whose sums the reference
orders otherwise). Two ranks, with accumulation and clipping: losses and norms within
rtol 2e-2 and the whole update within 10% in norm of the reference's (the test_parity.py
bf16 tolerances; the ranks' bf16 gradient sums round otherwise than one process's). The
fp8 gather with bf16 masters gathers the same bits as the bf16 gather. Checkpoints keep
bf16 masters and state, resume bit for bit, and cross-load with fp32 masters both ways.
With CPU offload the host keeps and steps the bf16 masters and state (torch's fused
AdamW too, on bf16 gradients): bit for bit at one rank on the CPU, eager and compiled,
and with offload_params under step_in_backward (the masters are the host's compute shards,
each gradient stepped as it lands and dropped). On CUDA (`--device cuda -m gpu`) the
offloaded cases' reference steps on the host too (its gradients brought down, AdamW on a
CPU copy, the results sent up): torch's CPU and CUDA AdamW round their fp32 results to
bf16 in their own ways, one bf16 step apart on a few elements (seen on an H100: the
engine's masters equal the host-stepped reference's at every step, the device-stepped
one's up to one step away), so only the host-stepped reference can be matched bit for
bit. Within the two-rank tolerances, fully and
partially offloaded, and a checkpoint resumes bit for bit (with offload_params too).
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file
from torch._dynamo.utils import counters

import zeroshard.compile as zc
import zeroshard.engine as zs
import zeroshard.engine.runtime.offload._host_offload as offload_module
from tests._dist import run_each, run_ranks, subtests
from tests.engine._models import (
    global_batches,
    loss_fn,
    make_model,
    make_optimizer,
    muon_and_adamw,
    reference_run,
)
from tests.engine._offload_train import train_and_collect
from zeroshard.engine.runtime.offload._compiled_step import step_piece

STEPS = 3
MICRO = 2
BF16 = {"compute_dtype": "bf16", "master_dtype": "bf16"}
STAGE3 = {"min_unit_params": 1, "persistence_threshold": 0}


def _bf16_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy whose parameters are bf16 (buffers keep their dtype, as the engine's do)."""
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.data = p.data.to(torch.bfloat16)
    return ref


def _train(
    model: Any,
    opt: zs.ZeroOptimizer,
    batches: torch.Tensor,
    clip: bool,
    device: str = "cpu",
    early: bool = False,
) -> list[float]:
    """This rank's part of `batches`; the global mean loss (and grad norm) of each step;
    `early`: each backward under step_in_backward."""
    world, rank = dist.get_world_size(), dist.get_rank()
    out = []
    for step in batches:
        total = torch.zeros(1, device=device)
        for micro in step:
            loss = loss_fn(model, micro[rank].to(device)) / len(step)
            with opt.step_in_backward() if early else contextlib.nullcontext():
                loss.backward()
            total += loss.detach()
        if clip:
            out.append(float(opt.clip_grad_norm_(0.5)))
        _check_bf16_state(opt)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        out.append(float(total) / world)
    return out


def _check_bf16_state(opt: zs.ZeroOptimizer, grads: bool = True) -> None:
    """Masters, their gradients and (after a first step) AdamW's moments are all bf16."""
    for g in opt.flat_groups:
        assert g.master.dtype == torch.bfloat16, g.index
        if g.trainable:
            # Stage 1 reduces its gradients in the step: no shard before it.
            if grads and g.master.grad is not None:
                assert g.master.grad.dtype == torch.bfloat16, g.index
            for key, value in opt.inner.state.get(g.master, {}).items():
                if key != "step":
                    assert value.dtype == torch.bfloat16, (g.index, key)


def _reference(
    model: torch.nn.Module, batches: torch.Tensor, clip: bool, make_opt: Any = make_optimizer
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The bf16 reference's losses (each step's norm first, when clipped) and state."""
    losses, norms, state = reference_run(
        _bf16_copy(model), make_opt, batches, 0.5 if clip else None
    )
    out = [x for pair in zip(norms, losses, strict=True) for x in pair] if clip else losses
    return out, state


def _bf16_run(
    model: torch.nn.Module, batches: torch.Tensor, device: str, host_step: bool = False
) -> list[float]:
    """The plain bf16 run of a copy of `model` on `device`, one process: its losses.
    `host_step`: AdamW steps a CPU copy of the parameters on the gradients brought down,
    as an offloaded step does, and the results go back up."""
    ref = _bf16_copy(model).to(device)
    host = _bf16_copy(model).cpu() if host_step else ref
    opt = make_optimizer(host)
    losses = []
    for step in batches:
        loss = loss_fn(ref, step.reshape(-1, step.shape[-1]).to(device))
        loss.backward()
        if host is not ref:
            for p, q in zip(ref.parameters(), host.parameters(), strict=True):
                q.grad = None if p.grad is None else p.grad.cpu()
                p.grad = None
        opt.step()
        opt.zero_grad()
        if host is not ref:
            with torch.no_grad():
                for p, q in zip(ref.parameters(), host.parameters(), strict=True):
                    p.copy_(q)
        losses.append(float(loss))
    model.load_state_dict(ref.state_dict())  # `model` now holds the reference's result
    return losses


def _one_rank_case(
    device: str, stage: int, compiled: bool, offload: bool = False, params: bool = False
) -> None:
    base = make_model(seed=stage).to(device)
    batches = global_batches(STEPS, 1, 1, MICRO)
    result = copy.deepcopy(base)
    # Offloaded, the host's CPU kernel steps: so does the reference's ([Note] above).
    ref = _bf16_run(result, batches, device, host_step=offload)
    config = {"stage": stage, **BF16, **(STAGE3 if stage == 3 else {})}
    if offload:
        config["offload_optimizer"] = True
    if params:
        # The masters are the host's compute shards; each gradient stepped as it lands.
        config["offload_params"] = True
    model, opt = zs.initialize(base, make_optimizer(base), config)
    run = zc.compile(model, backend="aot_eager") if compiled else model
    assert _train(run, opt, batches, False, device, early=params) == ref
    if compiled:
        assert not run.eager and run.compiles == 1
    full = zs.full_state_dict(model)
    for name, value in result.state_dict().items():
        if name != "offset":  # the buffer: fp32 in both
            assert full[name].dtype == torch.bfloat16, name
        # `result`'s parameters are fp32 again; they hold the reference's bf16 values.
        ours, theirs = full[name].float(), value.cpu().float()
        assert torch.equal(ours, theirs), _differences(name, ours, theirs)


def _differences(name: str, ours: torch.Tensor, ref: torch.Tensor) -> str:
    """How far `ours` is from `ref`: the largest absolute and relative difference, and
    how many elements differ (so a failure on a GPU says its size)."""
    diff = (ours - ref).abs()
    rel = diff / ref.abs().clamp_min(torch.finfo(torch.float32).tiny)
    k = int(diff.argmax())
    return (
        f"{name}: {int((diff > 0).sum())} of {ref.numel()} elements differ; largest absolute "
        f"difference {float(diff.max()):.3g} (at {k}: {float(ours.view(-1)[k]):.6g} against "
        f"{float(ref.view(-1)[k]):.6g}), largest relative {float(rel.max()):.3g}"
    )


def _one_rank(device: str) -> None:
    cases = [dict(stage=s, compiled=False) for s in (1, 2, 3)] + [dict(stage=3, compiled=True)]
    cases += [dict(stage=s, compiled=False, offload=True) for s in (1, 2, 3)]
    cases.append(dict(stage=3, compiled=True, offload=True))
    cases.append(dict(stage=3, compiled=False, offload=True, params=True))
    run_each(cases, lambda **c: _one_rank_case(device, **c))


@pytest.mark.gpu
def test_one_rank_bit_for_bit(device: str) -> None:
    run_ranks(_one_rank, 1, device, device=device)


def _fused_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW with torch's fused kernel (the blocked host step under offload)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), fused=True)


def _two_rank_case(
    stage: int,
    accum: int,
    clip: bool,
    muon: bool = False,
    offload: float = 0.0,
    fused: bool = False,
) -> None:
    world = dist.get_world_size()
    base = make_model(seed=10 + stage)
    batches = global_batches(STEPS, accum, world, MICRO)
    make_opt = muon_and_adamw if muon else _fused_adamw if fused else make_optimizer
    ref, ref_state = _reference(base, batches, clip, make_opt)
    initial = {k: v.detach().float().clone() for k, v in base.state_dict().items()}
    config = {"stage": stage, **BF16, "reduce_bucket_bytes": 1500, **(STAGE3 if stage == 3 else {})}
    if offload:
        config.update(offload_optimizer=True, offload_ratio=offload, reduce_dtype="bf16")
    model, opt = zs.initialize(base, make_opt(base), config)
    if offload:
        on_host = [g for g in opt.flat_groups if g.home.kind is zs.HomeKind.HOST]
        assert on_host and all(g.master.device.type == "cpu" for g in on_host)
    torch.testing.assert_close(_train(model, opt, batches, clip), ref, rtol=2e-2, atol=1e-2)
    full = zs.full_state_dict(model)
    trained = [k for k in initial if k not in ("frozen.weight", "frozen.bias", "offset")]
    ours = torch.cat([(full[k].float() - initial[k]).reshape(-1) for k in trained])
    theirs = torch.cat([(ref_state[k].float() - initial[k]).reshape(-1) for k in trained])
    err = float((ours - theirs).norm() / theirs.norm())
    assert err < 0.10, f"the update differs from the reference's by {err:.1%}"
    assert torch.equal(full["frozen.weight"], ref_state["frozen.weight"])


def _one_rounding(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Within one bf16 rounding step of `ref`, and equal but for 1% of the elements at most
    ([Note: bf16 masters in the compiled step])."""
    a, b = ours.float(), ref.float()
    bound = torch.finfo(torch.bfloat16).eps * b.abs()
    assert bool(((a - b).abs() <= bound).all()), f"{what}: off by more than a rounding"
    assert int((a != b).sum()) <= b.numel() // 100 + 1, f"{what}: {int((a != b).sum())} differ"


def _compiled_step_case(stage: int, early: bool = False, params: bool = False) -> None:
    """One rank, the whole global batch: after one step every master and moment within
    one bf16 rounding of torch's fused AdamW stepping bf16 parameters in one process (the
    same gradients: the forward and backward are torch's bit for bit, as
    test_one_rank_bit_for_bit checks), and the next steps' losses within test_parity's
    bf16 rtol."""
    base = make_model(seed=20 + stage)
    batches = global_batches(STEPS, 1, 1, MICRO)
    ref = _bf16_copy(base)
    ref_opt = _fused_adamw(ref)
    config = {"stage": stage, **BF16, "offload_optimizer": True, "offload_compiled_step": True}
    config |= {"offload_params": params, **(STAGE3 if stage == 3 else {})}
    model, opt = zs.initialize(base, _fused_adamw(base), config)
    losses, ref_losses = [], []
    stepped = mock.patch.object(offload_module, "step_piece", wraps=step_piece)
    for k, step in enumerate(batches):
        tokens = step.reshape(-1, step.shape[-1])
        loss = loss_fn(ref, tokens)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(float(loss))
        loss = loss_fn(model, tokens)
        with opt.step_in_backward() if early else contextlib.nullcontext(), stepped as calls:
            loss.backward()
            _check_bf16_state(opt, grads=False)
            opt.step()
        assert calls.call_count > 0, "the compiled step did not run"
        opt.zero_grad()
        losses.append(float(loss))
        if k == 0:
            full = zs.full_state_dict(model)
            for name, value in ref.state_dict().items():
                _one_rounding(full[name], value, name)
            for name, p in ref.named_parameters():
                state = zs.full_optimizer_state(model, name)
                for key in ("exp_avg", "exp_avg_sq") if p.requires_grad else ():
                    _one_rounding(state[key], ref_opt.state[p][key], f"{key} of {name}")
    assert losses[0] == ref_losses[0]
    torch.testing.assert_close(losses, ref_losses, rtol=2e-2, atol=1e-2)


def _compiled_modes_case(stage: int, accum: int) -> None:
    """The compiled bf16 step after backward and inside it, bit for bit: 2 ranks, the
    gradients bf16 or accumulated in fp32 (no clipping: step_in_backward refuses it), with
    nothing compiled after initialize."""
    runs = []
    for early in (False, True):
        base = make_model(seed=30 + stage)
        config = {"stage": stage, **BF16, "reduce_bucket_bytes": 1500, "offload_optimizer": True}
        config |= {"offload_chunk_bytes": 2000, "offload_compiled_step": True}
        model, opt = zs.initialize(base, _fused_adamw(base), config)
        compiled = counters["stats"]["unique_graphs"]
        runs.append(
            train_and_collect(model, opt, steps=STEPS, accum=accum, micro=MICRO, early=early)
        )
        # initialize compiled the bf16 kernels: the steps compile nothing.
        assert counters["stats"]["unique_graphs"] == compiled, "a step compiled again"
    serial, early_run = runs
    assert early_run.losses == serial.losses
    for name, value in serial.weights.items():
        assert torch.equal(early_run.weights[name], value), name
    for a, b in zip(early_run.state, serial.state, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)


def _compiled_modes() -> None:
    run_each([dict(stage=2, accum=2), dict(stage=2, accum=1)], _compiled_modes_case)


def test_compiled_host_step_in_backward_is_the_serial_step() -> None:
    run_ranks(_compiled_modes, 2)


def _compiled_steps() -> None:
    cases = [dict(stage=1), dict(stage=2, early=True), dict(stage=3, early=True, params=True)]
    run_each(cases, _compiled_step_case)


def test_compiled_host_step_against_torchs_fused_adamw() -> None:
    run_ranks(_compiled_steps, 1)


def _fp8_gather_same_bits() -> None:
    """Stage 3 with bf16 masters: torchao's fp8 weights gathered in fp8 and in bf16 train
    the same bits (the fp8 gather casts the bf16 master as Float8Linear casts the weight)."""
    from tests.engine._float8 import batches as fp8_batches
    from tests.engine._float8 import make_net, train
    from tests.engine._float8 import make_optimizer as fp8_optimizer

    data = fp8_batches(STEPS, 1, dist.get_world_size())
    runs = []
    for gather in (False, True):
        net = make_net(2, "tensorwise", gather, "cpu")
        model, opt = zs.initialize(net, fp8_optimizer(net), {"stage": 3, **BF16, **STAGE3})
        stats = zs.engine_stats(model)
        losses = train(model, opt, data, None, opt.clip_grad_norm_, "cpu")
        assert (stats.scale_reductions > 0) == gather
        runs.append((losses, zs.full_state_dict(model)))
    (losses, state), (losses8, state8) = runs
    assert losses8 == losses
    for name, value in state.items():
        assert torch.equal(state8[name], value), name


def _two_ranks() -> None:
    cases = subtests({"stage": [1, 2, 3], "accum": [2], "clip": [True]})
    cases += [dict(stage=3, accum=1, clip=False), dict(stage=3, accum=1, clip=True, muon=True)]
    cases += [
        dict(stage=2, accum=2, clip=True, offload=1.0, fused=True),
        dict(stage=3, accum=1, clip=True, offload=1.0),
        dict(stage=3, accum=2, clip=True, offload=0.5, fused=True),
    ]
    run_each(cases, _two_rank_case)


def test_two_ranks_match_one_bf16_process() -> None:
    run_ranks(_two_ranks, 2)


def _fp8() -> None:
    run_each([{}], _fp8_gather_same_bits)


def test_fp8_gather_with_bf16_masters() -> None:
    pytest.importorskip("torchao")
    run_ranks(_fp8, 2)


def _engine(
    stage: int, masters: str, offload: bool = False, params: bool = False, compiled: bool = False
) -> tuple[torch.nn.Module, zs.ZeroOptimizer]:
    base = make_model(seed=7)
    config = {"stage": stage, "compute_dtype": "bf16", "master_dtype": masters, **STAGE3}
    if offload:
        config |= {
            "offload_optimizer": True,
            "offload_params": params,
            "offload_compiled_step": compiled,
        }
    make_opt = _fused_adamw if compiled else make_optimizer
    return zs.initialize(base, make_opt(base), config)


def _steps(model: torch.nn.Module, opt: zs.ZeroOptimizer, first: int, n: int) -> None:
    """Steps first .. first + n - 1 of one batch sequence, clipped."""
    rank = dist.get_rank()
    for step in global_batches(first + n, 1, dist.get_world_size(), MICRO)[first:]:
        loss_fn(model, step[0, rank]).backward()
        opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()


def _masters(opt: zs.ZeroOptimizer) -> list[torch.Tensor]:
    return [g.master.detach().clone() for g in opt.flat_groups]


def _moments(opt: zs.ZeroOptimizer) -> list[torch.Tensor]:
    return [opt.inner.state[g.master]["exp_avg"].clone() for g in opt.flat_groups if g.trainable]


def _checkpoint_case(root: str) -> None:
    from zeroshard.ckpt import consolidate

    model, opt = _engine(3, "bf16")
    _steps(model, opt, 0, 2)
    zs.save_checkpoint(model, opt, f"{root}/bf16", step=2)
    saved, saved_full = _masters(opt), zs.full_state_dict(model)
    with safe_open(f"{root}/bf16/step-2/rank{dist.get_rank():05d}.safetensors", "pt") as f:
        keys = [k for k in f.keys() if ".master" in k or ".optim." in k]  # noqa: SIM118
        kinds = {k: f.get_slice(k).get_dtype() for k in keys}
    assert kinds and set(kinds.values()) == {"BF16"}, kinds
    _steps(model, opt, 2, 2)
    # Resumed on a fresh engine: the same bits.
    again, again_opt = _engine(3, "bf16")
    assert zs.load_checkpoint(again, again_opt, f"{root}/bf16") == 2
    _check_bf16_state(again_opt, grads=False)
    _steps(again, again_opt, 2, 2)
    full, resumed = zs.full_state_dict(model), zs.full_state_dict(again)
    for name, value in full.items():
        assert torch.equal(resumed[name], value), name
    # The bf16 checkpoint into fp32 masters: upcast exactly.
    wide, wide_opt = _engine(3, "fp32")
    zs.load_checkpoint(wide, wide_opt, f"{root}/bf16")
    for a, b in zip(_masters(wide_opt), saved, strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b.float())
    # An fp32-master checkpoint into bf16 masters: masters and moments rounded to bf16.
    _steps(wide, wide_opt, 2, 1)
    zs.save_checkpoint(wide, wide_opt, f"{root}/fp32", step=3)
    narrow, narrow_opt = _engine(3, "bf16")
    zs.load_checkpoint(narrow, narrow_opt, f"{root}/fp32")
    _check_bf16_state(narrow_opt, grads=False)
    for a, b in zip(_masters(narrow_opt), _masters(wide_opt), strict=True):
        assert torch.equal(a, b.to(torch.bfloat16))
    for a, b in zip(_moments(narrow_opt), _moments(wide_opt), strict=True):
        assert torch.equal(a, b.to(torch.bfloat16))
    _steps(narrow, narrow_opt, 3, 1)  # and trains on from there
    # Consolidated: the bf16 masters exactly (written in fp32), loadable into the model.
    if dist.get_rank() == 0:
        consolidate(f"{root}/bf16", f"{root}/out.safetensors")
        plain = make_model(seed=0)
        # The tied head is written once, under the embedding's name (as Hugging Face does).
        missing, unexpected = plain.load_state_dict(
            load_file(f"{root}/out.safetensors"), strict=False
        )
        assert (missing, unexpected) == (["head.weight"], [])
        for name, value in plain.state_dict().items():
            assert torch.equal(value, saved_full[name].float()), name
    dist.barrier()


def _offload_checkpoint_case(root: str, stage: int, params: bool, compiled: bool) -> None:
    """Offloaded bf16 masters: the rank files hold them and their state in bf16, and a
    resume continues bit for bit (with offload_params, loaded into the masters that are
    the host's compute shards); so too with offload_compiled_step."""
    model, opt = _engine(stage, "bf16", offload=True, params=params, compiled=compiled)
    _steps(model, opt, 0, 2)
    _check_bf16_state(opt, grads=False)
    path = f"{root}/host{stage}{'-compiled' if compiled else ''}"
    zs.save_checkpoint(model, opt, path, step=2)
    _steps(model, opt, 2, 2)
    again, again_opt = _engine(stage, "bf16", offload=True, params=params, compiled=compiled)
    assert zs.load_checkpoint(again, again_opt, path) == 2
    _steps(again, again_opt, 2, 2)
    full, resumed = zs.full_state_dict(model), zs.full_state_dict(again)
    for name, value in full.items():
        assert torch.equal(resumed[name], value), name


def _checkpoints(root: str) -> None:
    run_each([{}], lambda: _checkpoint_case(root))
    run_each(
        [
            dict(stage=2, params=False, compiled=False),
            dict(stage=3, params=True, compiled=False),
            dict(stage=2, params=False, compiled=True),
        ],
        lambda **c: _offload_checkpoint_case(root, **c),
    )


def test_checkpoints(tmp_path: Path) -> None:
    run_ranks(_checkpoints, 2, str(tmp_path))


def test_config_spellings_and_refusals() -> None:
    cfg = zs.ZeroConfig.from_dict(BF16)
    assert cfg.precision.master_dtype == torch.bfloat16
    assert cfg.to_dict()["master_dtype"] == "bf16"
    assert zs.ZeroConfig.from_dict(cfg.to_dict()) == cfg
    nested = {"precision": {"compute_dtype": "bf16", "master_dtype": torch.bfloat16}}
    assert zs.ZeroConfig.from_dict(nested) == cfg
    assert zs.ZeroConfig().precision.master_dtype == torch.float32
    compiled = {**BF16, "offload_optimizer": True, "offload_compiled_step": True}
    assert zs.ZeroConfig.from_dict(compiled).offload.compiled_step
    for bad, match in (
        ({"master_dtype": "bf16"}, "needs compute_dtype bf16"),
        ({"compute_dtype": "fp16", "master_dtype": "fp16"}, "needs compute_dtype bf16"),
        ({"compute_dtype": "bf16", "master_dtype": "int8"}, "not a dtype"),
    ):
        with pytest.raises(ValueError, match=match):
            zs.ZeroConfig.from_dict(bad)


def test_deepspeed_bf16_master_keys() -> None:
    def ds(**bf16: Any) -> dict[str, Any]:
        return {"bf16": {"enabled": True, **bf16}, "zero_optimization": {"stage": 3}}

    both = {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    cfg = zs.ZeroConfig.from_dict(ds(**both))
    assert cfg.precision.master_dtype == torch.bfloat16 and cfg.stage == 3
    assert zs.ZeroConfig.from_dict(ds()).precision.master_dtype == torch.float32
    for bad, match in (
        (ds(bf16_master_weights_and_grads=True), "set bf16_optimizer_states too"),
        (ds(bf16_optimizer_states=True), "needs bf16.bf16_master_weights_and_grads"),
        ({**ds(**both), "bf16": {"enabled": False, **both}}, "needs bf16.enabled"),
        (ds(bf16_master_weights_and_grads="yes", bf16_optimizer_states=True), "true or false"),
        (ds(immediate_grad_update=True), "unknown bf16 keys"),
    ):
        with pytest.raises(ValueError, match=match):
            zs.ZeroConfig.from_dict(bad)
