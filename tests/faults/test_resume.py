"""`resume_checkpoint` picks the newest complete checkpoint, the same on every rank."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zeroshard.engine as zs
from tests._dist import run_ranks
from tests._logs import logged
from tests.engine._models import global_batches, loss_fn, make_model, make_optimizer
from zeroshard.ckpt import CheckpointError


def _on_rank0(fn: object) -> None:
    """Change the files on rank 0 only, then let every rank see the change."""
    if dist.get_rank() == 0:
        fn()  # type: ignore[operator]
    dist.barrier()


def _resume_cases(root_s: str) -> None:
    root = Path(root_s)
    model = make_model(11)
    model, opt = zs.initialize(model, make_optimizer(model), {"stage": 3, "min_unit_params": 1})
    data: dict[str, object] = {"data": None}
    # A fresh start: one INFO line on rank 0, no warning (every first run printed one).
    with logged() as lines, warnings.catch_warnings():
        warnings.simplefilter("error")
        assert zs.resume_checkpoint(model, opt, root, client_state=data) is None
    assert data["data"] is None
    fresh = f"resume: {root} does not exist: starting from step 0"
    assert lines == ([fresh] if dist.get_rank() == 0 else []), lines
    saved = {}
    for step in range(1, 4):
        batch = global_batches(4, 1, 12, 1)[step, 0]
        loss_fn(model, batch.reshape(2, -1, batch.shape[-1])[dist.get_rank()]).backward()
        opt.step()
        opt.zero_grad()
        zs.save_checkpoint(model, opt, root, step=step, client_state={"data": step})
        saved[step] = zs.full_state_dict(model)

    def check(step: int) -> None:
        with logged() as lines:
            got = zs.resume_checkpoint(model, opt, root, client_state=data)
        assert got == step and data["data"] == step
        # One line on rank 0: the checkpoint, its step, the world sizes then and now.
        said = f"resumed from {root / f'step-{step}'} at step {step} (world size 2 then, 2 now)"
        assert lines == ([said] if dist.get_rank() == 0 else []), lines
        now = zs.full_state_dict(model)
        assert all(torch.equal(now[k], v) for k, v in saved[step].items())

    check(3)
    # Killed after step-3's commit rename, before `latest` moved; and a killed save's
    # temp folder: `latest` (step-2) is what a restart loads.
    _on_rank0(lambda: (root / "latest").write_text("step-2\n"))
    _on_rank0(lambda: (root / ".step-4.tmp").mkdir())
    check(2)
    # step-2 loses rank 1's file: every rank skips it for step-1, with a warning.
    _on_rank0(lambda: (root / "step-2" / "rank00001.safetensors").unlink())
    warned = pytest.warns(UserWarning, match="skipping checkpoint .*step-2.*missing rank00001")
    with warned if dist.get_rank() == 0 else contextlib.nullcontext():
        check(1)
    # step-1 is damaged too: no checkpoint loads, and none is started over from step 0.
    _on_rank0(lambda: (root / "step-1" / "rank00000.safetensors").unlink())
    damaged = r"every checkpoint under .* is damaged \(step-2, step-1\)"
    with pytest.raises(CheckpointError, match=damaged), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zs.resume_checkpoint(model, opt, root, client_state=data)


def test_resume_newest_complete(tmp_path: Path) -> None:
    """None on an empty root; `latest` over a newer uncommitted or not-yet-latest one;
    a checkpoint missing a rank's file skipped on every rank for the previous one; an
    error on every rank when every checkpoint is damaged."""
    run_ranks(_resume_cases, 2, str(tmp_path / "ckpt"))
