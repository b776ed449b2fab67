"""The user's own state in engine checkpoints: client_state (global) and rank_state."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import zeroshard.engine as zs
from tests._dist import run_ranks
from tests.engine._models import global_batches, loss_fn, make_model, make_optimizer
from zeroshard.ckpt import CheckpointError


def _build() -> tuple[torch.nn.Module, zs.ZeroOptimizer, torch.optim.lr_scheduler.LRScheduler]:
    model = make_model(11)
    model, opt = zs.initialize(model, make_optimizer(model), {"stage": 3, "min_unit_params": 1})
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _step(model: torch.nn.Module, opt: zs.ZeroOptimizer, sched: object, step: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = global_batches(4, 1, 12, 1)[step, 0]
    loss_fn(model, batch.reshape(world, -1, batch.shape[-1])[rank]).backward()
    opt.step()
    opt.zero_grad()
    sched.step()  # type: ignore[attr-defined]


def _draws() -> tuple[torch.Tensor, float, float]:
    return torch.rand(4), random.random(), float(np.random.rand())


PLAIN = {"epoch": 3, "pairs": {7: ("a", 1.5), "__odd": [None, True]}, "t": torch.arange(5.0)}


def _save_then_load(root: str, async_save: bool) -> None:
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    np.random.seed(300 + rank)
    model, opt, sched = _build()
    for s in range(3):
        _step(model, opt, sched, s)
    handle = zs.save_checkpoint(
        model,
        opt,
        root,
        step=3,
        async_save=async_save,
        client_state={"sched": sched, **PLAIN},
        rank_state={"rng": zs.RNGState(), "position": 40 + rank},
    )
    expected = _draws()  # what the RNGs give right after the save
    sched_state = copy.deepcopy(sched.state_dict())
    lr = opt.param_groups[0]["lr"]
    if handle is not None:
        handle.wait()
    # Move everything on, then load: the saved values come back.
    _step(model, opt, sched, 3)
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    fresh = torch.optim.lr_scheduler.StepLR(opt, step_size=9, gamma=0.1)
    client: dict[str, object] = {"sched": fresh, "epoch": None, "pairs": None, "t": None}
    mine: dict[str, object] = {"rng": zs.RNGState(), "position": None}
    assert zs.load_checkpoint(model, opt, root, client_state=client, rank_state=mine) == 3
    assert fresh.state_dict() == sched_state and sched_state["last_epoch"] == 3
    assert opt.param_groups[0]["lr"] == lr
    assert client["epoch"] == 3 and client["pairs"] == PLAIN["pairs"]
    assert isinstance(client["pairs"], dict) and isinstance(client["pairs"][7], tuple)
    assert torch.equal(client["t"], PLAIN["t"])  # type: ignore[arg-type]
    assert mine["position"] == 40 + rank
    got = _draws()
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
    # Only what was asked for is restored; asking for what was not saved names it.
    with pytest.raises(CheckpointError, match=r"has no entry \['nope'\]"):
        zs.load_checkpoint(model, opt, root, client_state={"nope": None})


@pytest.mark.parametrize("async_save", [False, True])
def test_user_state_round_trip(tmp_path: Path, async_save: bool) -> None:
    """Scheduler, plain data (tuples, int keys, tensors) and per-rank RNG and data
    position come back exactly, from a sync and an async save; no pickle on disk."""
    root = tmp_path / "ckpt"
    run_ranks(_save_then_load, 2, str(root), async_save)
    for r in range(2):
        raw = (root / "step-3" / f"rank{r:05d}.safetensors").read_bytes()
        assert b"pickle" not in raw and b"\x80\x04" not in raw[:64]
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + n])
        extra = json.loads(header["__metadata__"]["zeroshard.extra"])
        # Global state is saved from rank 0 only; each rank has its own per-rank state.
        assert set(extra) == ({"client_state", "rank_state"} if r == 0 else {"rank_state"})
        assert extra["rank_state"]["position"] == 40 + r


def _other_world(root: str) -> None:
    model, opt, sched = _build()
    client: dict[str, object] = {"sched": sched, "epoch": None}
    with pytest.raises(CheckpointError, match="saved by 2 ranks; this job has 1: per-rank"):
        zs.load_checkpoint(model, opt, root, client_state=client, rank_state={"rng": None})
    assert client["epoch"] is None  # nothing changed by a refused load
    assert zs.load_checkpoint(model, opt, root, client_state=client) == 3
    assert client["epoch"] == 3 and sched.last_epoch == 3


def _bad_input(root: str) -> None:
    model, opt, sched = _build()
    with pytest.raises(CheckpointError, match=r"client_state\['x'\]\[0\] is a builtins.object"):
        zs.save_checkpoint(model, opt, root, step=1, client_state={"x": [object()]})
    zs.save_checkpoint(model, opt, root, step=2)
    with pytest.raises(CheckpointError, match="holds no client_state"):
        zs.load_checkpoint(model, opt, root, client_state={"sched": sched})


def test_user_state_other_world_and_bad_input(tmp_path: Path) -> None:
    """Global state loads at another world size, per-rank state is refused clearly;
    unstorable values and state that was never saved are errors on every rank."""
    root = tmp_path / "ckpt"
    run_ranks(_save_then_load, 2, str(root), False)
    run_ranks(_other_world, 1, str(root))
    run_ranks(_bad_input, 2, str(tmp_path / "bad"))
