"""A load that fails changes nothing, on any rank; arguments that differ between ranks
are one error on every rank (never a hang); a bad step is refused before anything is
written; a failed async save costs only itself; state the writer cannot fit in a file
is refused at save, not found unreadable at load."""

from __future__ import annotations

import resource
import signal
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks
from tests.engine._models import make_model
from tests.faults._engine import TIMEOUT_S, assert_same_bits, build, train_step
from zeroshard.ckpt import CheckpointError, list_checkpoints, read_latest


class Counter:
    """A user `Stateful` whose load fails on one rank."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.count = 0
        self.fail_on = fail_on

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]  # changed before it fails: the undo must put it back
        if dist.get_rank() == self.fail_on and self.count == 5:
            raise KeyError("the scheduler's state has no 'milestones'")


def _optimizer_state(opt: zs.ZeroOptimizer) -> tuple[list[dict[str, Any]], list[torch.Tensor]]:
    inner = opt.inner
    groups = [{k: v for k, v in pg.items() if k != "params"} for pg in inner.param_groups]
    tensors = [t.clone() for st in inner.state.values() for t in st.values()]
    return groups, tensors


def _unchanged(model: nn.Module, opt: zs.ZeroOptimizer, before: Any) -> None:
    weights, (groups, tensors) = before
    assert_same_bits(zs.full_state_dict(model), weights)
    now_groups, now_tensors = _optimizer_state(opt)
    assert now_groups == groups
    assert all(torch.equal(a, b) for a, b in zip(now_tensors, tensors, strict=True))


def _load_faults(root_s: str) -> None:
    root = Path(root_s)
    rank = dist.get_rank()
    model, opt = build(2)
    train_step(model, opt, 0)
    saved = Counter()
    saved.count = 5
    zs.save_checkpoint(model, opt, root, step=1, client_state={"sched": saved, "data": 1})
    good = zs.full_state_dict(model)
    train_step(model, opt, 1)  # the live state differs from the checkpoint

    def snapshot() -> Any:
        return zs.full_state_dict(model), _optimizer_state(opt)

    def stateful_fails_on_rank1() -> None:
        before = snapshot()
        sched = Counter(fail_on=1)
        client: dict[str, Any] = {"sched": sched, "data": "mine"}
        with pytest.raises(CheckpointError, match=r"failed on rank\(s\) \[1\].*milestones"):
            zs.load_checkpoint(model, opt, root, client_state=client)
        _unchanged(model, opt, before)
        assert sched.count == 0 and client["data"] == "mine", (sched.count, client)

    def optimizer_with_other_groups() -> None:
        other = make_model(11)
        one_group = torch.optim.AdamW(other.parameters(), lr=0.5, weight_decay=0.0)
        cfg = {"stage": 2, "collective_timeout_s": TIMEOUT_S}
        other, other_opt = zs.initialize(other, one_group, cfg)
        before = zs.full_state_dict(other), _optimizer_state(other_opt)
        with pytest.raises(CheckpointError, match=r"2 param group\(s\), this optimizer has 1"):
            zs.load_checkpoint(other, other_opt, root)
        _unchanged(other, other_opt, before)
        assert other_opt.inner.param_groups[0]["lr"] == 0.5

    def arguments_differ_between_ranks() -> None:
        other = root.parent / "other"
        zs.save_checkpoint(model, opt, other, step=2)  # the live state, another checkpoint
        before = snapshot()
        mine = root / "step-1" if rank == 0 else other / "step-2"
        with pytest.raises(ValueError, match=r"ranks disagree at load_checkpoint on checkpoint"):
            zs.load_checkpoint(model, opt, mine)  # different paths, both fine: what they hold
        _unchanged(model, opt, before)
        client = {"data": None} if rank == 0 else None
        for call in (zs.load_checkpoint, zs.resume_checkpoint):
            with pytest.raises(ValueError, match=r"ranks disagree at \w+ on client_state"):
                call(model, opt, root, client_state=client)
        _unchanged(model, opt, before)
        with pytest.raises(ValueError, match=r"ranks disagree at save_checkpoint on step"):
            zs.save_checkpoint(model, opt, root, step=7 + rank)
        assert list_checkpoints(root) == ["step-1"]

    def bad_steps_are_refused_before_writing() -> None:
        for bad in ("4", True, 4.5, -1, torch.tensor(4.0)):
            with pytest.raises(CheckpointError, match=r"step must be"):
                zs.save_checkpoint(model, opt, root, step=bad)  # type: ignore[arg-type]
        assert list_checkpoints(root) == ["step-1"]
        assert not [p for p in root.iterdir() if p.name.startswith(".")]
        for i, step in enumerate((np.int64(4), torch.tensor(5))):
            zs.save_checkpoint(model, opt, root, step=step)  # type: ignore[arg-type]
            got = zs.load_checkpoint(model, opt, root)
            assert got == 4 + i and type(got) is int, got
        assert list_checkpoints(root) == ["step-1", "step-4", "step-5"]

    def failed_async_save_costs_only_itself() -> None:
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        if rank == 1:  # rank 1's file may not grow past 1 KiB: its background write fails
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
        try:
            failed = zs.save_checkpoint(model, opt, root, step=6, async_save=True)
            for t in threading.enumerate():  # the write is over (it failed on rank 1)
                if t.name.startswith("zeroshard-save-"):
                    t.join()
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        train_step(model, opt, 2)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            zs.save_checkpoint(model, opt, root, step=7)
        said = [str(w.message) for w in seen if "async save" in str(w.message)]
        if rank == 0:
            assert len(said) == 1 and "'step-6' failed" in said[0] and "rank(s) [1]" in said[0]
        else:
            assert not said, said
        assert read_latest(root) == "step-7" and "step-6" not in list_checkpoints(root)
        newest = zs.full_state_dict(model)
        assert zs.load_checkpoint(model, opt, root) == 7
        assert_same_bits(zs.full_state_dict(model), newest)
        with pytest.raises(CheckpointError, match="writing the shards failed"):
            assert failed is not None
            failed.wait()  # the failure stays the handle's, with no collective

    def client_state_too_big_for_a_file() -> None:
        big = {"data": "x" * 100_000_001}
        with pytest.raises(CheckpointError, match=r"100,000,000 a safetensors header may hold"):
            zs.save_checkpoint(model, opt, root, step=8, client_state=big)
        assert "step-8" not in list_checkpoints(root)
        assert not [p for p in root.iterdir() if p.name.startswith(".")]
        assert zs.resume_checkpoint(model, opt, root) == 7

    cases = {
        f.__name__: f
        for f in (
            stateful_fails_on_rank1,
            optimizer_with_other_groups,
            arguments_differ_between_ranks,
            bad_steps_are_refused_before_writing,
            failed_async_save_costs_only_itself,
            client_state_too_big_for_a_file,
        )
    }

    def run(case: str) -> None:
        try:
            cases[case]()
        except pytest.fail.Exception as e:  # reported with the others, not past them
            raise AssertionError(str(e)) from None

    run_each([{"case": name} for name in cases], run)
    # After all that, the first checkpoint still loads as it was saved.
    assert zs.load_checkpoint(model, opt, root, step=1) == 1
    assert_same_bits(zs.full_state_dict(model), good)


def test_failed_loads_and_saves_change_nothing(tmp_path: Path) -> None:
    """A user Stateful failing on rank 1, an optimizer with other param groups, ranks
    loading different checkpoints, client_state on rank 0 only (load and resume) or steps
    that differ (save), steps "4", True, 4.5,
    -1 and a float tensor, a failed async save followed by the next save, a client_state
    too big for a safetensors header: each an error on every rank within the timeout,
    with the model, optimizer and user state as they were."""
    run_ranks(_load_faults, 2, str(tmp_path / "ckpt"), timeout_s=240)
