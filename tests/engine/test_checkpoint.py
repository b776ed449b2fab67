"""Engine checkpoints: exact resume, resharding to other world sizes, consolidation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import zeroshard.engine as zs
from tests._dist import run_ranks, world_fits
from tests._logs import logged
from tests.engine._models import global_batches, loss_fn, make_model, make_optimizer
from zeroshard.ckpt import ModelMismatchError, consolidate

STEPS = 4


def _build(
    stage: int, device: str, dtype: str = "fp32"
) -> tuple[torch.nn.Module, zs.ZeroOptimizer]:
    model = make_model(11).to(device)
    cfg = {"stage": stage, "compute_dtype": dtype, "reduce_bucket_bytes": 1500}
    if stage == 3:
        cfg.update(min_unit_params=1, persistence_threshold=0)
    return zs.initialize(model, make_optimizer(model), cfg)


def _train(model: torch.nn.Module, opt: zs.ZeroOptimizer, step: int, device: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = global_batches(STEPS, 1, 12, 1)[step, 0]  # 12 samples: split evenly over 1-4 ranks
    mine = batch.reshape(world, -1, batch.shape[-1])[rank].to(device)
    loss_fn(model, mine).backward()
    opt.step()
    opt.zero_grad()


def _save_side(root: str, stage: int, device: str) -> None:
    model, opt = _build(stage, device)
    for s in range(2):
        _train(model, opt, s, device)
    zs.save_checkpoint(model, opt, root, step=2)
    saved = zs.full_state_dict(model)
    _train(model, opt, 2, device)
    after = zs.full_state_dict(model)
    if dist.get_rank() == 0:
        save_file({k: v.clone() for k, v in saved.items()}, f"{root}/saved.safetensors")
        save_file({k: v.clone() for k, v in after.items()}, f"{root}/after.safetensors")
    # Resume in place at the same world size: bit-identical continuation.
    _train(model, opt, 3, device)
    assert zs.load_checkpoint(model, opt, root) == 2
    _train(model, opt, 2, device)
    again = zs.full_state_dict(model)
    for k in after:
        assert torch.equal(after[k], again[k]), f"{k} differs after resuming"


def _load_side(root: str, stage: int, device: str) -> None:
    model, opt = _build(stage, device)
    with logged() as lines:
        assert zs.load_checkpoint(model, opt, root) == 2
    world = dist.get_world_size()
    said = f"resumed from {root}/step-2 at step 2 (world size 2 then, {world} now)"
    assert lines == ([said] if dist.get_rank() == 0 else []), lines
    saved = load_file(f"{root}/saved.safetensors")
    loaded = zs.full_state_dict(model)
    for k in saved:
        assert torch.equal(saved[k], loaded[k]), f"{k} differs after resharding"
    # One step on the resharded state matches the step taken at the saving world size
    # (the reduction order differs with the world size, so not to the bit).
    _train(model, opt, 2, device)
    after = load_file(f"{root}/after.safetensors")
    stepped = zs.full_state_dict(model)
    for k in after:
        torch.testing.assert_close(stepped[k], after[k], rtol=1e-5, atol=1e-6, msg=k)


def _wrong_model(root: str) -> None:
    model = torch.nn.Linear(3, 5)
    model, opt = zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"stage": 2})
    with pytest.raises(ModelMismatchError, match="weight"):
        zs.load_checkpoint(model, opt, root)


@pytest.mark.gpu
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_checkpoint_resume_and_reshard(stage: int, tmp_path: Path, device: str) -> None:
    world_fits(device, 2)
    root = str(tmp_path / "ckpt")
    run_ranks(_save_side, 2, root, stage, device, device=device)
    for world in (1, 3):
        if device == "cpu" or torch.cuda.device_count() >= world:
            run_ranks(_load_side, world, root, stage, device, device=device)
    # The engine's checkpoint consolidates (no model code) to exactly full_state_dict.
    out = tmp_path / "hf"
    consolidate(root, out)
    files = sorted(out.glob("*.safetensors"))
    merged: dict[str, torch.Tensor] = {}
    for f in files:
        merged.update(load_file(str(f)))
    saved = load_file(f"{root}/saved.safetensors")
    for k, v in merged.items():
        assert torch.equal(v, saved[k]), k
    assert "head.weight" not in merged and "emb.weight" in merged, "the tied weight, once"
    if stage == 2:
        run_ranks(_wrong_model, 1, root)
