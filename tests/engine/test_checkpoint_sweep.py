"""Checkpoints load at any stage, world size and mesh shape, for every optimizer structure.

A checkpoint is saved after one step at each stage (1, 2, 3) with each optimizer
structure (AdamW with two param groups; torch's [Muon, AdamW]; [AdamW, AdamW]) on 2
ranks, with the default config (so the saving and the loading run have as many flat
groups, named alike, holding other parameters: what once failed with "group 'group0' of
the checkpoint is of another model"). Each loads at the other two stages on 2 ranks, at
another stage on 3 ranks and on 1: the weights are the saved ones bit for bit, and one
more step matches the saving run's (fp32, rtol 1e-5; the reduction order differs). A
tensor-parallel model (dp 2 x tp 2, AdamW with two param groups) does the same at every
stage on its mesh, and loads at dp 4 without one; [AdamW, AdamW] on it, saved at stage 3,
loads at stage 1 on the mesh and at stage 2 without. One spawned job per world size
saves or loads every combination.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks
from tests.engine import _tp
from tests.engine._models import make_model, make_optimizer, muon_and_adamw
from tests.faults._engine import assert_same_bits, train_step

STAGES = (1, 2, 3)


def _two_adamw(model: nn.Module) -> list[torch.optim.Optimizer]:
    """Several optimizers of one kind: AdamW on the matrices, AdamW without decay on the rest."""
    decay, rest = (pg["params"] for pg in make_optimizer(model).param_groups)
    return [torch.optim.AdamW(decay, lr=1e-3), torch.optim.AdamW(rest, lr=2e-3, weight_decay=0)]


Structure = Callable[[nn.Module], torch.optim.Optimizer | list[torch.optim.Optimizer]]
STRUCTURES: dict[str, Structure] = {
    "groups": make_optimizer,
    "muon": muon_and_adamw,
    "two_adamw": _two_adamw,
}
TP_STRUCTURES: dict[str, Structure] = {"groups": _tp.make_optimizer, "two_adamw": _two_adamw}


def _build(structure: str, stage: int) -> tuple[nn.Module, zs.ZeroOptimizer]:
    model = make_model(11)
    return zs.initialize(model, STRUCTURES[structure](model), {"stage": stage})


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), what
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=f"{what}: {k}")


def _loads(
    build: Callable[[], tuple[nn.Module, zs.ZeroOptimizer]],
    step: Callable[[nn.Module, zs.ZeroOptimizer], None],
    path: Path,
    what: str,
) -> None:
    """`path` loads into `build()`'s engine with the saved weights; a step then matches."""
    expected = torch.load(path / "expected.pt")
    model, opt = build()
    assert zs.load_checkpoint(model, opt, path) == 1, what
    assert_same_bits(zs.full_state_dict(model), expected["saved"])
    step(model, opt)
    _close(zs.full_state_dict(model), expected["after"], what)


def _save(model: nn.Module, opt: zs.ZeroOptimizer, path: Path, step: Callable[..., None]) -> None:
    """Save after one step; keep the saved weights and those one step later beside it."""
    step(model, opt, 0)
    zs.save_checkpoint(model, opt, path, step=1)
    saved = zs.full_state_dict(model)
    step(model, opt, 1)
    after = zs.full_state_dict(model)
    if dist.get_rank() == 0:
        torch.save({"saved": saved, "after": after}, path / "expected.pt")


def _save_and_load_on_two(root_s: str) -> None:
    root = Path(root_s)
    for structure in STRUCTURES:
        for stage in STAGES:
            _save(*_build(structure, stage), root / f"{structure}-{stage}", train_step)
    dist.barrier()

    def case(structure: str, saved: int, stage: int) -> None:
        _loads(
            lambda: _build(structure, stage),
            lambda m, o: train_step(m, o, 1),
            root / f"{structure}-{saved}",
            f"{structure} saved at stage {saved}, loaded at {stage}",
        )

    run_each(
        [
            {"structure": s, "saved": a, "stage": b}
            for s in STRUCTURES
            for a in STAGES
            for b in STAGES
            if a != b
        ],
        case,
    )


def _load_elsewhere(root_s: str, shift: int) -> None:
    """At another world size, each checkpoint at stage `saved + shift` (mod 3)."""
    root = Path(root_s)

    def case(structure: str, saved: int) -> None:
        stage = STAGES[(saved - 1 + shift) % 3]
        _loads(
            lambda: _build(structure, stage),
            lambda m, o: train_step(m, o, 1),
            root / f"{structure}-{saved}",
            f"{structure} saved at stage {saved} on 2 ranks, loaded at {stage} on "
            f"{dist.get_world_size()}",
        )

    run_each([{"structure": s, "saved": a} for s in STRUCTURES for a in STAGES], case)


def _tp_step(model: nn.Module, opt: zs.ZeroOptimizer, step: int, dp: int, dp_rank: int) -> None:
    batch = _tp.batches(2, 1, 2)[step].reshape(-1, _tp.SEQ + 1)
    _tp.loss_fn(model, batch.chunk(dp)[dp_rank]).backward()
    opt.step()
    opt.zero_grad()


def _tensor_parallel(root_s: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    root = Path(root_s)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")

    def split(structure: str, stage: int) -> tuple[nn.Module, zs.ZeroOptimizer]:
        model, _ = _tp.split_model(mesh, sp=True, seed=5)
        opt = TP_STRUCTURES[structure](model)
        return zs.initialize(model, opt, {"stage": stage}, device_mesh=mesh)

    def plain(structure: str, stage: int) -> tuple[nn.Module, zs.ZeroOptimizer]:
        torch.manual_seed(5)
        model = _tp.TPModel()
        return zs.initialize(model, TP_STRUCTURES[structure](model), {"stage": stage})

    def on_mesh(m: nn.Module, o: zs.ZeroOptimizer, step: int) -> None:
        _tp_step(m, o, step, 2, dp_rank)

    for stage in STAGES:
        _save(*split("groups", stage), root / f"tp-groups-{stage}", on_mesh)
    _save(*split("two_adamw", 3), root / "tp-two_adamw-3", on_mesh)
    dist.barrier()

    def case(structure: str, saved: int, stage: int, meshed: bool) -> None:
        _loads(
            (lambda: split(structure, stage)) if meshed else (lambda: plain(structure, stage)),
            (lambda m, o: on_mesh(m, o, 1))
            if meshed
            else (lambda m, o: _tp_step(m, o, 1, 4, dist.get_rank())),
            root / f"tp-{structure}-{saved}",
            f"tp {structure} saved at stage {saved}, loaded at {stage}, mesh: {meshed}",
        )

    cases: list[dict[str, Any]] = [
        {"structure": "groups", "saved": a, "stage": b, "meshed": True}
        for a in STAGES
        for b in STAGES
        if a != b
    ]
    cases += [
        {"structure": "groups", "saved": a, "stage": STAGES[a % 3], "meshed": False} for a in STAGES
    ]
    cases += [
        {"structure": "two_adamw", "saved": 3, "stage": 1, "meshed": True},
        {"structure": "two_adamw", "saved": 3, "stage": 2, "meshed": False},
    ]
    run_each(cases, case)


def test_checkpoints_load_at_any_stage_world_and_structure(tmp_path: Path) -> None:
    root = str(tmp_path)
    run_ranks(_save_and_load_on_two, 2, root, timeout_s=400)
    run_ranks(_load_elsewhere, 3, root, 1, timeout_s=300)
    run_ranks(_load_elsewhere, 1, root, 2, timeout_s=300)


def test_tensor_parallel_checkpoints_load_at_any_stage(tmp_path: Path) -> None:
    run_ranks(_tensor_parallel, 4, str(tmp_path), timeout_s=400)
