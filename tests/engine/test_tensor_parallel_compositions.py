"""Tensor parallelism (`initialize(..., device_mesh=...)`) with the features it composes
with, on 4 gloo ranks, each against a run nobody here wrote: a plain single-process
PyTorch run of the unsplit model on the global batch, or DeepSpeed's own continuation.

- torch.optim.Muon on the hidden matrices (split over tp: colwise `up` and `head`,
  rowwise `down`) with AdamW on the rest, at dp 2 x tp 2, stages 2 and 3 (sequence
  parallelism at 3): every weight within fp32's tolerance of torch's Muon on the whole
  matrices (orthogonalizing each tp piece alone fails it);
- a 3-D mesh, hybrid sharding over (dp_replicate, dp_shard, tp) = (2, 1, 2) and
  (1, 2, 2), stages 2 and 3, clipping: losses, clip norms and weights at fp32's
  tolerance;
- a meta-device model parallelized by torch and materialized unit by unit at stage 3,
  its `param_init` writing `distribute_tensor` of each whole value: the initial weights
  are the reference's bit for bit, and it trains as the reference does;
- a DeepSpeed ZeRO-2 checkpoint (tests/ckpt/fixtures/deepspeed/resume_tied_even_stage2,
  made by DeepSpeed 0.19.8) resumed at dp 2 x tp 2 and trained two steps: DeepSpeed's
  losses and weights after them (atol 1e-6).

Every case but the DeepSpeed one saves a checkpoint after two steps, trains one more,
and a fresh engine of the same combination loads it and trains that step bit for bit.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks
from tests.engine import _tp
from tests.engine._models import muon_and_adamw, parity_atol
from tests.engine.test_deepspeed_resume import FIXTURES, _fixture_module
from tests.engine.test_tensor_parallel import engine_config
from zeroshard.ckpt._names import canonical_name

STEPS = 3
HYBRID = ("dp_replicate", "dp_shard", "tp")

Build = Callable[[], tuple[nn.Module, zs.ZeroOptimizer]]


def _mesh(shape: tuple[int, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    names = ("dp", "tp") if len(shape) == 2 else HYBRID
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _dp(mesh: Any) -> tuple[int, int]:
    """The data-parallel size and this rank's data-parallel index (over every dp dim)."""
    if mesh.ndim == 2:
        return mesh["dp"].size(), mesh.get_local_rank("dp")
    shard = mesh["dp_shard"].size()
    return mesh["dp_replicate"].size() * shard, (
        mesh.get_local_rank("dp_replicate") * shard + mesh.get_local_rank("dp_shard")
    )


def _train(
    model: nn.Module, opt: zs.ZeroOptimizer, data: torch.Tensor, steps: range, mesh: Any, clip: bool
) -> tuple[list[float], list[float]]:
    """This data-parallel rank's part of each step's global batch: the global mean losses
    and the clip norms."""
    return _tp.train(model, opt, data, steps, _dp(mesh)[1], clip=0.5 if clip else None)


def _reference(
    model: nn.Module,
    make: Callable[[nn.Module], list[torch.optim.Optimizer]],
    data: torch.Tensor,
    clip: bool,
) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """`model` (unsplit) trained in one process on each step's whole global batch."""
    opts = make(model)
    losses, norms = [], []
    for step in data:
        loss = _tp.loss_fn(model, step.reshape(-1, step.shape[-1]))
        loss.backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        for o in opts:
            o.step()
            o.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _close(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str, muon: bool = False
) -> None:
    """`a` against the reference's `b`; `muon`: trained by `muon_and_adamw` (`parity_atol`)."""
    assert a.keys() == b.keys(), what
    for k in a:
        atol = parity_atol(k, b[k]) if muon else 1e-6
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=atol, msg=f"{what}: {k}")


def _resumes(build: Build, data: torch.Tensor, mesh: Any, root: Path, clip: bool) -> None:
    """Train two steps, save, train the third; a fresh engine loads and trains it alike."""
    model, opt = build()
    _train(model, opt, data, range(2), mesh, clip)
    zs.save_checkpoint(model, opt, root, step=2, overwrite=True)
    _train(model, opt, data, range(2, 3), mesh, clip)
    again, opt2 = build()
    assert zs.load_checkpoint(again, opt2, root) == 2
    _train(again, opt2, data, range(2, 3), mesh, clip)
    want, got = zs.full_state_dict(model), zs.full_state_dict(again)
    for k, v in want.items():
        assert torch.equal(got[k], v), f"{k}: the resume is not bit-identical"


def _parity(
    build: Build,
    reference: nn.Module,
    make: Callable[[nn.Module], list[torch.optim.Optimizer]],
    mesh: Any,
    clip: bool,
    root: Path,
) -> None:
    data = _tp.batches(STEPS, 1, _dp(mesh)[0])
    ref_losses, ref_norms, ref_state = _reference(reference, make, data, clip)
    model, opt = build()
    losses, norms = _train(model, opt, data, range(STEPS), mesh, clip)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=1e-6)
    _close(zs.full_state_dict(model), ref_state, "trained", muon=make is muon_and_adamw)
    _resumes(build, data, mesh, root, clip)


def _muon_case(stage: int, root: str) -> None:
    mesh = _mesh((2, 2))
    sp = stage == 3

    def build() -> tuple[nn.Module, zs.ZeroOptimizer]:
        model, _ = _tp.split_model(mesh, sp=sp, seed=stage)
        return zs.initialize(
            model, muon_and_adamw(model), engine_config(stage, "fp32"), device_mesh=mesh
        )

    _, reference = _tp.split_model(mesh, sp=sp, seed=stage)
    _parity(build, reference, muon_and_adamw, mesh, False, Path(root) / f"muon{stage}")


def _hybrid_case(shape: tuple[int, int, int], stage: int, root: str) -> None:
    mesh = _mesh(shape)

    def build() -> tuple[nn.Module, zs.ZeroOptimizer]:
        model, _ = _tp.split_model(mesh, sp=True, seed=stage)
        opt = _tp.make_optimizer(model)
        return zs.initialize(model, opt, engine_config(stage, "fp32"), device_mesh=mesh)

    _, reference = _tp.split_model(mesh, sp=True, seed=stage)
    model, _ = build()
    state = zs.engine_state(model)
    assert (state.replicate is not None) == (shape[0] > 1)
    assert state.groups[0].process_group.size == shape[1]
    del model
    make = lambda m: [_tp.make_optimizer(m)]  # noqa: E731
    _parity(build, reference, make, mesh, True, Path(root) / f"hybrid{shape[0]}{stage}")


def _whole_value(name: str, shape: torch.Size) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g) * 0.3


def _meta_case(root: str) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = _mesh((2, 2))
    reference = _tp.TPModel()
    with torch.no_grad():
        for n, p in reference.named_parameters():
            p.copy_(_whole_value(n, p.shape))
    live: list[int] = []

    def build() -> tuple[nn.Module, zs.ZeroOptimizer]:
        with torch.device("meta"):
            model = _tp.TPModel()
        model.register_buffer("scale", reference.scale.clone())
        parallelize_module(model, mesh["tp"], _tp.tp_plan(sp=False))
        names = {id(m): n for n, m in model.named_modules()}

        def init(module: nn.Module) -> None:
            live.append(sum(data_numel(p) for p in model.parameters() if not p.is_meta))
            for pname, p in module.named_parameters(recurse=False):
                prefix = names[id(module)]
                whole = _whole_value(f"{prefix}.{pname}" if prefix else pname, p.shape)
                if isinstance(p, DTensor):
                    # Each rank its piece, no collective (every rank holds the whole value).
                    whole = distribute_tensor(
                        whole, p.device_mesh, p.placements, src_data_rank=None
                    )
                p.copy_(whole)

        cfg = engine_config(3, "fp32")
        opt = _tp.make_optimizer(model)
        return zs.initialize(model, opt, cfg, device_mesh=mesh, param_init=torch.no_grad()(init))

    model, _ = build()
    _close(zs.full_state_dict(model), dict(reference.state_dict()), "materialized")
    # One unit's local pieces in full at a time, never the model's.
    units = zs.engine_state(model).stage3
    assert units is not None
    biggest = max(sum(g.layout.numel for g in u.groups) for u in units.units)
    assert max(live) <= biggest < sum(g.layout.numel for u in units.units for g in u.groups)
    del model
    make = lambda m: [_tp.make_optimizer(m)]  # noqa: E731
    _parity(build, reference, make, mesh, True, Path(root) / "meta")


def data_numel(p: torch.Tensor) -> int:
    """Elements this rank holds of `p` (a DTensor's local piece)."""
    from torch.distributed.tensor import DTensor

    return (p.to_local() if isinstance(p, DTensor) else p).numel()


def _deepspeed_case() -> None:
    """DeepSpeed's ZeRO-2 checkpoint of TiedLM(dim=16, hidden=32) at dp 2 x tp 2 (up colwise,
    down rowwise; the tied embedding and head replicated), two steps on DeepSpeed's
    batches: its losses and weights."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    case = "resume_tied_even_stage2"
    mf = _fixture_module()
    ref = json.loads((FIXTURES / case / "resume.json").read_text())
    mesh = _mesh((2, 2))
    dp, me = _dp(mesh)
    torch.manual_seed(99)  # every weight must come from the checkpoint
    model = mf.MODELS["tied_even"]()
    plan: dict[str, Any] = {}
    for i in range(3):
        plan.update({f"blocks.{i}.up": ColwiseParallel(), f"blocks.{i}.down": RowwiseParallel()})
    parallelize_module(model, mesh["tp"], plan)
    decay = [p for n, p in model.named_parameters() if p.requires_grad and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and "norm" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest}], lr=1e-3)
    model, zopt = zs.initialize(model, opt, {"stage": ref["stage"]}, device_mesh=mesh)
    assert zs.load_checkpoint(model, zopt, FIXTURES / case) == 2
    losses = []
    for batch in torch.tensor(ref["batches"]):
        tokens = batch.chunk(dp)[me]
        loss = mf.rank_loss(model(tokens), tokens)
        loss.backward()
        zopt.clip_grad_norm_(ref["clip"])
        zopt.step()
        zopt.zero_grad()
        total = loss.detach().reshape(1)
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
    torch.testing.assert_close(losses, ref["losses"], rtol=1e-6, atol=0)
    want = load_file(FIXTURES / case / "continued.safetensors")
    got = zs.full_state_dict(model)
    for name, value in want.items():
        torch.testing.assert_close(got[canonical_name(name)], value, rtol=0, atol=1e-6, msg=name)


def _all(root: str) -> None:
    run_each([{"stage": 2}, {"stage": 3}], lambda stage: _muon_case(stage, root))
    hybrid = [{"shape": (2, 1, 2), "stage": 2}, {"shape": (1, 2, 2), "stage": 3}]
    hybrid += [{"shape": (2, 1, 2), "stage": 3}]
    run_each(hybrid, lambda shape, stage: _hybrid_case(shape, stage, root))
    run_each([{}], lambda: _meta_case(root))
    run_each([{}], _deepspeed_case)


def test_tensor_parallel_compositions(tmp_path: Path) -> None:
    """Muon, a 3-D mesh, meta-device init and a DeepSpeed checkpoint under tensor
    parallelism, each with a checkpoint resumed (see the module docstring)."""
    run_ranks(_all, 4, str(tmp_path), timeout_s=400)
