"""Every rank reaches the same outcome: initialize, load and the divergent-unit check."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch import nn

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks, world_fits
from tests.engine._models import make_model, make_optimizer
from tests.faults._engine import TIMEOUT_S, assert_same_bits, build, train_step
from zeroshard.ckpt import CheckpointError, ChecksumError
from zeroshard.ckpt._keys import rank_file
from zeroshard.comm import Group
from zeroshard.engine import DivergentRanksError
from zeroshard.engine.runtime._stage3 import Stage3Runtime
from zeroshard.engine.runtime._stats import EngineStats
from zeroshard.engine.runtime._unit_plan import UnitPlan


def _disagree(
    field: str, path: str, rank0: Any, rank1: Any, extra_layer: bool, shown: str, device: str
) -> None:
    rank = dist.get_rank()
    model = make_model(11).to(device)
    if extra_layer and rank == 1:
        model.extra = nn.Linear(3, 3).to(device)
    cfg = {"stage": 2, "collective_timeout_s": TIMEOUT_S, field: rank0 if rank == 0 else rank1}
    with pytest.raises(ValueError) as info:
        zs.initialize(model, make_optimizer(model), cfg)
    msg = str(info.value)
    want = "parameter" if extra_layer else f"config.{path}"
    assert f"ranks disagree at initialize on {want}" in msg, msg
    assert "rank(s) [0]" in msg and "rank(s) [1]" in msg, msg
    if extra_layer:
        assert "(absent)" in msg, msg
    assert shown in msg, msg


def _disagreements(device: str) -> None:
    if device == "cpu":  # one spawn for both: a process start costs seconds on CI
        run_each([{}], _unit_counts_differ)
    cases = [
        {
            "field": "stage",
            "path": "stage",
            "rank0": 2,
            "rank1": 3,
            "extra_layer": False,
            "shown": "= 3",
        },
        {
            "field": "compute_dtype",
            "path": "precision.compute_dtype",
            "rank0": "fp32",
            "rank1": "bf16",
            "extra_layer": False,
            "shown": "[0]: config.precision.compute_dtype = torch.float32; rank(s) [1]: "
            "config.precision.compute_dtype = torch.bfloat16",
        },
        {
            "field": "stage",
            "path": "stage",
            "rank0": 2,
            "rank1": 2,
            "extra_layer": True,
            "shown": "extra.weight",
        },
    ]
    run_each([dict(c, device=device) for c in cases], _disagree)
    # The group is still sound after the error: the same call on agreeing ranks works.
    build(2, device=device)


@pytest.mark.gpu
def test_ranks_that_disagree_get_one_error(device: str) -> None:
    """initialize's digest; on gloo also the per-gather unit check (NCCL compares the
    gather order once per step instead, see runtime/_stage3.py)."""
    world_fits(device, 2)
    run_ranks(_disagreements, 2, device, device=device, timeout_s=150)


def _unit_counts_differ() -> None:
    rank = dist.get_rank()
    # Units without parameters: the check before each gather is all that runs.
    plans = [(UnitPlan(f"block{i}", nn.Identity(), (), False), ()) for i in range(2 + rank)]
    group = Group(timeout=datetime.timedelta(seconds=TIMEOUT_S))
    runtime = Stage3Runtime(
        plans,
        shard_group=group,
        prefetch_depth=0,
        prefetch_bytes=0,
        max_live_bytes=2**40,
        persistence_threshold=0,
        stats=EngineStats(),
    )
    units = runtime.units  # rank 1 has one unit more
    with pytest.raises(DivergentRanksError) as info:
        units[-1].gather()  # rank 0: block1, rank 1: block2 (unknown to rank 0)
    mine = f"unit {1 + rank} (block{1 + rank})"
    other = "unit 2" if rank == 0 else "unit 1 (block1)"  # rank 0 knows no unit 2: its index
    msg = str(info.value)
    assert f"gathering {mine} while another rank is gathering {other}:" in msg, msg


def _damage(path: Path, how: str) -> None:
    if how == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) - 7])
    elif how == "flip":
        data = bytearray(path.read_bytes())
        data[-5] ^= 0x10  # one bit of the last tensor's bytes
        path.write_bytes(bytes(data))
    else:
        path.write_text('{"format_version": 1, "world_size": ')


def _load_damaged(root: str, device: str) -> None:
    rank = dist.get_rank()
    model, opt = build(2, device=device)
    train_step(model, opt, 0)
    zs.save_checkpoint(model, opt, root, step=1)
    good = zs.full_state_dict(model)
    train_step(model, opt, 1)
    zs.save_checkpoint(model, opt, root, step=2)
    after = zs.full_state_dict(model)

    def case(how: str) -> None:
        target = Path(root, "step-2", rank_file(1) if how != "metadata" else "metadata.json")
        if rank == 0:
            backup = target.read_bytes()
            _damage(target, how)
        dist.barrier()
        want = CheckpointError if how == "metadata" else ChecksumError
        with pytest.raises(want) as info:
            zs.load_checkpoint(model, opt, root, step=2)
        msg = str(info.value)
        assert "failed on rank(s)" in msg, msg
        if how != "metadata":  # only rank 1 reads its file: both ranks name it
            assert "failed on rank(s) [1]" in msg and rank_file(1) in msg, msg
        # The previous checkpoint still loads, bit-identical.
        assert zs.load_checkpoint(model, opt, root, step=1) == 1
        assert_same_bits(zs.full_state_dict(model), good)
        dist.barrier()
        if rank == 0:
            target.write_bytes(backup)
        dist.barrier()
        assert zs.load_checkpoint(model, opt, root, step=2) == 2
        assert_same_bits(zs.full_state_dict(model), after)

    run_each([{"how": h} for h in ("truncate", "flip", "metadata")], case)


@pytest.mark.gpu
def test_damaged_checkpoint_fails_on_every_rank(tmp_path: Path, device: str) -> None:
    world_fits(device, 2)
    run_ranks(_load_damaged, 2, str(tmp_path), device, device=device, timeout_s=150)
