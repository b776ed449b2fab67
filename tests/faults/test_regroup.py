"""A checkpoint saved with another stage, `reduce_bucket_bytes` or `min_unit_params`
loads: parameter names and shapes are the contract, the flat grouping is not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks, world_fits
from tests.faults._engine import assert_same_bits, build, train_step


def _regroup(root: str, device: str) -> None:
    saved_model, saved_opt = build(
        2, device=device
    )  # reduce_bucket_bytes=1500: several flat groups
    train_step(saved_model, saved_opt, 0)
    zs.save_checkpoint(saved_model, saved_opt, root, step=1)
    saved = zs.full_state_dict(saved_model)
    train_step(saved_model, saved_opt, 1)  # optimizer state must have come along too
    stepped = zs.full_state_dict(saved_model)

    def case(**cfg: Any) -> None:
        model, opt = build(device=device, **cfg)
        assert zs.load_checkpoint(model, opt, root) == 1
        assert_same_bits(zs.full_state_dict(model), saved)
        train_step(model, opt, 1)
        got = zs.full_state_dict(model)
        for k in stepped:
            torch.testing.assert_close(got[k], stepped[k], rtol=1e-5, atol=1e-6, msg=k)

    run_each(
        [
            {"stage": 3},
            {"stage": 3, "min_unit_params": 10**6},
            {"stage": 1, "reduce_bucket_bytes": 10**6},
            {"stage": 2, "reduce_bucket_bytes": 400},
        ],
        case,
    )


@pytest.mark.gpu
def test_checkpoint_loads_at_another_grouping(tmp_path: Path, device: str) -> None:
    world_fits(device, 2)
    run_ranks(_regroup, 2, str(tmp_path), device, device=device, timeout_s=240)
