"""A user's own whole-matrix optimizer (one that declares `zeroshard_whole_params`) with
CPU offload and under tensor parallelism, against one process running the same
optimizer on the whole, unsplit matrices.

`Factored` is such an optimizer, written here as a user would: Adafactor's factored
second moment (a row and a column vector per matrix: state not shaped like the
parameter, and an int step count) and an update clipped to unit RMS over the whole
matrix, so that stepping a shard's or a tp rank's piece alone gives other values. It
steps the 2-D weights (the tied embedding aside), AdamW the rest.

- Offload (2 ranks, stage 2; stage 3 with part of the groups offloaded): its state on
  the host beside the offloaded masters, its step on the device (the same device here).
- Tensor parallelism (dp 2 x tp 2, stage 3; stage 2 offloaded): each matrix's pieces
  joined whole at its owner on every tp rank. The stage-3 checkpoint loads at dp 1 x tp 2
  and in one process (its state is the whole matrices'), and a step from there matches
  the reference's; offloaded, a snapshot in memory restores and the step after it
  repeats.

Weights at fp32's tolerance (rtol 1e-5) after 3 steps with clipping; each case saves
after step 2 and an engine built afresh loads it and repeats step 3 bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks
from tests.engine import _tp
from tests.engine._models import global_batches, loss_fn, make_model
from tests.engine.test_tensor_parallel import engine_config

STEPS = 3
CLIP = 0.5


class Factored(torch.optim.Optimizer):
    """A whole-matrix optimizer: Adafactor's factored second moment and an update
    clipped to unit RMS over the whole matrix."""

    zeroshard_whole_params = True

    def __init__(self, params: Iterable[nn.Parameter], lr: float, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.reshape(p.shape[0], -1)
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["row"] = grad.new_zeros(grad.shape[0])
                    state["col"] = grad.new_zeros(grad.shape[1])
                state["step"] += 1
                square = grad.square() + 1e-30
                state["row"].lerp_(square.mean(1), 1 - group["beta"])
                state["col"].lerp_(square.mean(0), 1 - group["beta"])
                v = torch.outer(state["row"], state["col"]) / state["row"].mean()
                update = grad / v.sqrt()
                update /= update.square().mean().sqrt().clamp_min(1.0)
                p.add_(update.view_as(p), alpha=-group["lr"])


def factored_and_adamw(model: nn.Module) -> list[torch.optim.Optimizer]:
    """`Factored` on the 2-D weights but a tied one (the embedding that is the head),
    AdamW on the rest."""
    names: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        names[id(p)] = names.get(id(p), 0) + 1
    params = [p for p in model.parameters() if p.requires_grad]
    whole = [p for p in params if p.dim() == 2 and names[id(p)] == 1]
    rest = [p for p in params if p.dim() != 2 or names[id(p)] > 1]
    return [Factored(whole, lr=0.02), torch.optim.AdamW(rest, lr=1e-2)]


def _reference(model: nn.Module, data: torch.Tensor, loss: Any) -> dict[str, torch.Tensor]:
    """`model` trained in one process on each step's whole global batch (`data[step]`
    flattened to sequences), clipped, by the same optimizers."""
    opts = factored_and_adamw(model)
    for step in data:
        loss(model, step.reshape(-1, step.shape[-1])).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for o in opts:
            o.step()
            o.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(
    model: nn.Module, opt: Any, data: torch.Tensor, steps: range, dp: int, me: int, loss: Any
) -> None:
    """Data-parallel rank `me` of `dp`: its part of each step's global batch."""
    for step in steps:
        flat = data[step].reshape(-1, data.shape[-1])
        loss(model, flat.chunk(dp)[me]).backward()
        opt.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), what
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=f"{what}: {k}")


def _resumes(build: Any, train: Any, root: Path) -> None:
    """Two steps, save, the third; a fresh engine loads and repeats the third bit for bit
    (the whole matrices' state at their owners came back)."""
    model, opt = build()
    train(model, opt, range(2))
    zs.save_checkpoint(model, opt, root, step=2, overwrite=True)
    train(model, opt, range(2, 3))
    again, opt2 = build()
    assert zs.load_checkpoint(again, opt2, root) == 2
    whole = opt2.inner.optimizers[0]
    assert all("row" in whole.state[p] for pg in whole.param_groups for p in pg["params"])
    train(again, opt2, range(2, 3))
    want, got = zs.full_state_dict(model), zs.full_state_dict(again)
    for k, v in want.items():
        assert torch.equal(got[k], v), f"{k}: the resume is not bit-identical"


def _snapshot(build: Any, train: Any, root: Path) -> None:
    """A snapshot in memory after step 1, restored after step 2: the state snapshotted
    (the whole matrices' at every tp rank of their owners too) and step 2 again, bit for
    bit."""
    model, opt = build()
    snaps = zs.Snapshots(model, opt, every=1, root=root / "shm")
    try:
        train(model, opt, range(1))
        snaps.take(1)
        saved = zs.full_state_dict(model)
        train(model, opt, range(1, 2))
        after = zs.full_state_dict(model)
        assert snaps.resume(root / "ckpt") == 1
        assert all(torch.equal(v, saved[k]) for k, v in zs.full_state_dict(model).items())
        train(model, opt, range(1, 2))
        assert all(torch.equal(v, after[k]) for k, v in zs.full_state_dict(model).items())
    finally:
        snaps.close()


# -- offload ------------------------------------------------------------------------------


def _offload_case(stage: int, extra: dict[str, Any], root: str) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    data = global_batches(STEPS, 1, world, 2)[:, 0]
    want = _reference(make_model(seed=3), data, loss_fn)
    cfg = {
        "stage": stage,
        "reduce_dtype": "fp32",
        "reduce_bucket_bytes": 1500,
        "offload_optimizer": True,
        **extra,
    }
    if stage == 3:
        cfg.update(min_unit_params=1, persistence_threshold=0)

    def build() -> tuple[nn.Module, Any]:
        model = make_model(seed=3)
        return zs.initialize(model, factored_and_adamw(model), cfg)

    model, opt = build()
    state = zs.engine_state(model)
    assert state.offload is not None and state.whole_params is not None
    hosted = [g for g in state.groups if g.trainable and state.offload.holds(g)]
    assert {s.name for g in hosted for s in g.layout.slots} & state.whole_params.names
    # On the host between steps: the state of the matrices of offloaded groups owned here.
    owned_hosted = state.whole_params.on_host
    assert owned_hosted <= set(state.whole_params.owned)

    def train(model: nn.Module, opt: Any, steps: range) -> None:
        _train(model, opt, data, steps, world, rank, loss_fn)

    train(model, opt, range(STEPS))
    _close(zs.full_state_dict(model), want, f"offloaded at stage {stage}")
    _resumes(build, train, Path(root) / f"offload{stage}")


def _offload(root: str) -> None:
    cases = [
        {"stage": 2, "extra": {}},
        {"stage": 3, "extra": {"offload_ratio": 0.5}},
    ]
    run_each(cases, lambda stage, extra: _offload_case(stage, extra, root))


def test_declared_whole_params_with_offload(tmp_path: Path) -> None:
    """Offloaded groups' matrices stepped whole by a user's optimizer (module docstring)."""
    run_ranks(_offload, 2, str(tmp_path))


def _where_state_lives(device: str, root: str) -> None:
    """One rank, every parameter on `Factored`: offloaded, its state's tensors are on the
    host between steps (pinned where the device is a GPU; its whole parameters on the
    device its step runs on), and it
    trains as the run without offload; a checkpoint of it loads into either, its state
    where that run keeps it, and the next step follows."""
    dev = torch.device(device, torch.cuda.current_device() if device == "cuda" else None)
    data = global_batches(STEPS, 1, 1, 2)[:, 0].to(dev)
    cfg = {"stage": 2, "reduce_dtype": "fp32", "reduce_bucket_bytes": 1500}

    def build(offload: bool) -> tuple[nn.Module, Any]:
        model = make_model(seed=5).to(dev)
        opt = Factored(model.parameters(), lr=0.02)
        return zs.initialize(model, opt, {**cfg, "offload_optimizer": offload})

    def state_on(opt: Any, where: str) -> dict[str, torch.Tensor]:
        whole = opt.inner.state
        out = {}
        for p, kept in whole.items():
            assert p.device.type == dev.type
            for key, t in kept.items():
                if isinstance(t, torch.Tensor):
                    assert t.device.type == where, (key, t.device)
                    # On the host of a GPU pinned, so its copies up and down go at the
                    # bus's speed (after a step and after a load alike).
                    assert where != "cpu" or t.is_pinned() == (dev.type == "cuda"), key
                    out[f"{id(p)}.{key}"] = t.cpu()
        return out

    def train(model: nn.Module, opt: Any, steps: range) -> None:
        for step in steps:
            loss_fn(model, data[step].reshape(-1, data.shape[-1])).backward()
            opt.step()
            opt.zero_grad()

    model, opt = build(offload=True)
    train(model, opt, range(2))
    state_on(opt, "cpu")
    zs.save_checkpoint(model, opt, Path(root) / "hosted", step=2)
    train(model, opt, range(2, STEPS))
    state_on(opt, "cpu")
    want = zs.full_state_dict(model)
    plain, plain_opt = build(offload=False)
    train(plain, plain_opt, range(STEPS))
    state_on(plain_opt, dev.type)
    _close(zs.full_state_dict(plain), want, "offloaded against on the device")
    for offload, where in ((True, "cpu"), (False, dev.type)):
        again, opt2 = build(offload)
        assert zs.load_checkpoint(again, opt2, Path(root) / "hosted") == 2
        state_on(opt2, where)
        train(again, opt2, range(2, STEPS))
        got = zs.full_state_dict(again)
        if offload:
            assert all(torch.equal(got[k], v) for k, v in want.items()), "not bit for bit"
        else:
            _close(got, want, "resumed on the device")


@pytest.mark.gpu
def test_declared_whole_params_state_lives_on_the_host(device: str, tmp_path: Path) -> None:
    """Where an offloaded declared optimizer's state lives (on one GPU with --device cuda,
    where the host is not the device)."""
    run_ranks(_where_state_lives, 1, device, str(tmp_path), device=device)


# -- tensor parallelism -------------------------------------------------------------------


def _mesh(dp: int, tp: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def _tp_case(stage: int, extra: dict[str, Any], root: str) -> None:
    mesh = _mesh(2, 2)
    dp, me = mesh["dp"].size(), mesh.get_local_rank("dp")
    data = _tp.batches(STEPS, 1, dp)[:, 0]
    _, reference = _tp.split_model(mesh, sp=False, seed=stage)
    want = _reference(reference, data, _tp.loss_fn)
    cfg = {**engine_config(stage, "fp32"), **extra}

    def build() -> tuple[nn.Module, Any]:
        model, _ = _tp.split_model(mesh, sp=False, seed=stage)
        return zs.initialize(model, factored_and_adamw(model), cfg, device_mesh=mesh)

    def train(model: nn.Module, opt: Any, steps: range) -> None:
        _train(model, opt, data, steps, dp, me, _tp.loss_fn)

    model, opt = build()
    train(model, opt, range(STEPS))
    _close(zs.full_state_dict(model), want, f"tp at stage {stage}")
    _resumes(build, train, Path(root) / f"tp{stage}")
    if extra:  # offloaded too
        _snapshot(build, train, Path(root) / f"snap{stage}")
    if dist.get_rank() == 0 and stage == 3:
        torch.save(want, Path(root) / "tp-want.pt")


def _tensor_parallel(root: str) -> None:
    cases = [{"stage": 3, "extra": {}}, {"stage": 2, "extra": {"offload_optimizer": True}}]
    run_each(cases, lambda stage, extra: _tp_case(stage, extra, root))


def _elsewhere(root: str, tp: int) -> None:
    """The dp 2 x tp 2 stage-3 checkpoint (after step 2) loaded at another tp size: step
    3 from there as the reference's."""
    data = _tp.batches(STEPS, 1, 2)[:, 0]
    if tp > 1:
        mesh = _mesh(1, tp)
        model, _ = _tp.split_model(mesh, sp=False, seed=9)
        model, opt = zs.initialize(
            model, factored_and_adamw(model), engine_config(2, "fp32"), device_mesh=mesh
        )
    else:
        torch.manual_seed(9)
        model = _tp.TPModel()
        model, opt = zs.initialize(model, factored_and_adamw(model), engine_config(2, "fp32"))
    assert zs.load_checkpoint(model, opt, Path(root) / "tp3") == 2
    _train(model, opt, data, range(2, 3), 1, 0, _tp.loss_fn)
    _close(zs.full_state_dict(model), torch.load(Path(root) / "tp-want.pt"), f"at tp {tp}")


def test_declared_whole_params_under_tensor_parallelism(tmp_path: Path) -> None:
    """Split matrices joined whole for a user's optimizer (module docstring)."""
    run_ranks(_tensor_parallel, 4, str(tmp_path))
    run_ranks(_elsewhere, 2, str(tmp_path), 2)
    run_ranks(_elsewhere, 1, str(tmp_path), 1)
