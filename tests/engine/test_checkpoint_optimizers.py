"""A checkpoint loads only into the optimizers that saved it.

Each param group's optimizer class is recorded (format version 6); a load into another
optimizer with param groups of the same shape ([Muon, AdamW] into AdamW with two param
groups, into [AdamW, AdamW], the reverse, the two optimizers swapped) is a
`CheckpointError` on every rank naming both classes, before anything changed: weights,
learning rates and optimizer state stay as they were. A checkpoint without the record
(format version 5 and earlier: the v1 fixture, and one rewritten as version 5) is
judged by its hyperparameter keys; the optimizers that saved it load it, and train on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks
from tests.engine._models import make_model, muon_and_adamw
from tests.faults._engine import assert_same_bits, train_step
from zeroshard.ckpt import CheckpointError, CheckpointMeta, describe

FIXTURES = Path(__file__).parents[1] / "ckpt" / "fixtures"


def _two_adamw(model: nn.Module) -> list[torch.optim.Optimizer]:
    """[AdamW, AdamW] over Muon's split (hidden matrices, the rest)."""
    muon, adamw = muon_and_adamw(model)
    hidden = muon.param_groups[0]["params"]
    return [torch.optim.AdamW(hidden, lr=1e-3), adamw]


def _adamw_groups(model: nn.Module) -> torch.optim.Optimizer:
    """One AdamW with Muon's split as its two param groups."""
    muon, adamw = muon_and_adamw(model)
    groups = [{"params": pg["params"]} for pg in (*muon.param_groups, *adamw.param_groups)]
    return torch.optim.AdamW(groups, lr=1e-3)


def _swapped(model: nn.Module) -> list[torch.optim.Optimizer]:
    """[AdamW, Muon]: torch's recipe with the two optimizers in the other order."""
    return list(reversed(muon_and_adamw(model)))


OPTIMIZERS = {
    "muon": muon_and_adamw,
    "two_adamw": _two_adamw,
    "adamw_groups": _adamw_groups,
    "swapped": _swapped,
}


def _build(kind: str) -> tuple[nn.Module, zs.ZeroOptimizer]:
    model = make_model(11)
    return zs.initialize(model, OPTIMIZERS[kind](model), {"stage": 2})


def _snapshot(model: nn.Module, opt: zs.ZeroOptimizer) -> Any:
    groups = [{k: v for k, v in pg.items() if k != "params"} for pg in opt.param_groups]
    state = [t.clone() for st in opt.state.values() for t in st.values()]
    return zs.full_state_dict(model), groups, state


def _unchanged(model: nn.Module, opt: zs.ZeroOptimizer, before: Any) -> None:
    weights, groups, state = _snapshot(model, opt)
    assert_same_bits(weights, before[0])
    assert groups == before[1]
    assert len(state) == len(before[2])
    assert all(torch.equal(a, b) for a, b in zip(state, before[2], strict=True))


def _as_version5(src: Path, dst: Path) -> None:
    """`src`'s checkpoint as an older build wrote it: format version 5, no record."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "metadata.json":
            (dst / f.name).write_bytes(f.read_bytes())
    d = json.loads((src / "metadata.json").read_text())
    assert d["version"] == 6 and len(d.pop("optimizers")) == 2
    d["version"] = 5
    (dst / "metadata.json").write_text(CheckpointMeta.from_dict(d).to_json())


def _other_optimizers(root_s: str) -> None:
    root = Path(root_s)
    saved = {}
    for kind in ("muon", "adamw_groups"):
        model, opt = _build(kind)
        train_step(model, opt, 0)
        zs.save_checkpoint(model, opt, root / kind, step=1)
        saved[kind] = zs.full_state_dict(model)
    if torch.distributed.get_rank() == 0:
        meta = json.loads((root / "muon" / "step-1" / "metadata.json").read_text())
        assert meta["optimizers"] == ["torch.optim.Muon", "torch.optim.adamw.AdamW"]
        assert describe(root / "muon").optimizers == tuple(meta["optimizers"])
        _as_version5(root / "muon" / "step-1", root / "muon5")
    torch.distributed.barrier()

    def refused(saved_by: str, into: str) -> None:
        model, opt = _build(into)
        train_step(model, opt, 1)  # state of its own, which must stay
        before = _snapshot(model, opt)
        with pytest.raises(CheckpointError, match="was saved with another optimizer") as e:
            zs.load_checkpoint(model, opt, root / saved_by)
        if saved_by == "muon5":  # no record: its hyperparameters tell
            assert "['adjust_lr_fn', 'momentum', 'nesterov', 'ns_coefficients'" in str(e.value)
        else:
            assert "Muon" in str(e.value) and "AdamW" in str(e.value), e.value
        _unchanged(model, opt, before)
        train_step(model, opt, 2)  # and it trains on

    run_each(
        [
            {"saved_by": "muon", "into": "adamw_groups"},
            {"saved_by": "muon", "into": "two_adamw"},
            {"saved_by": "muon", "into": "swapped"},
            {"saved_by": "adamw_groups", "into": "muon"},
            {"saved_by": "muon5", "into": "adamw_groups"},
        ],
        refused,
    )

    def loads(saved_by: str, into: str) -> None:
        model, opt = _build(into)
        assert zs.load_checkpoint(model, opt, root / saved_by) == 1
        assert_same_bits(zs.full_state_dict(model), saved[into])
        lrs = [pg["lr"] for pg in opt.param_groups]
        assert lrs == ([0.02, 1e-3] if into == "muon" else [1e-3, 1e-3]), lrs
        train_step(model, opt, 1)

    run_each(
        [
            {"saved_by": "muon", "into": "muon"},
            {"saved_by": "muon5", "into": "muon"},
            {"saved_by": "adamw_groups", "into": "adamw_groups"},
        ],
        loads,
    )

    # The v1 fixture (an older build's AdamW, no record): AdamW loads it, SGD is refused.
    fixture = FIXTURES / "zeroshard_v1"
    want = load_file(FIXTURES / "zeroshard_v1-expected.safetensors")
    for cls in (torch.optim.AdamW, torch.optim.SGD):
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        model, opt = zs.initialize(model, cls(model.parameters(), lr=0.5), {"stage": 3})
        if cls is torch.optim.SGD:
            with pytest.raises(CheckpointError, match=r"\['amsgrad', 'betas'.*not its \["):
                zs.load_checkpoint(model, opt, fixture)
            assert opt.param_groups[0]["lr"] == 0.5
        else:
            zs.load_checkpoint(model, opt, fixture)
            assert_same_bits(zs.full_state_dict(model), want)
            assert opt.param_groups[0]["lr"] == 0.1


def test_a_checkpoint_loads_only_into_its_optimizers(tmp_path: Path) -> None:
    run_ranks(_other_optimizers, 2, str(tmp_path), timeout_s=240)
