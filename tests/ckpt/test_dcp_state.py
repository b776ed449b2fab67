"""`read_dcp_training_state`: where a DCP checkpoint keeps the model, the optimizer and the
step, however the job nested them, and the checkpoints it refuses (one process, `dcp.save`
of hand-built state dicts; FSDP2's own checkpoints: tests/engine/test_dcp_resume.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from zeroshard.ckpt import (
    CheckpointError,
    UnsafePickleError,
    is_dcp_checkpoint,
    read_dcp_training_state,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _save(state: dict[str, Any], path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=path)
    return path


def _optimizer(steps: tuple[float, float], names: tuple[str, str]) -> dict[str, Any]:
    return {
        "state": {
            n: {"step": torch.tensor(s), "exp_avg": torch.full((2, 3), s)}
            for n, s in zip(names, steps, strict=True)
        },
        "param_groups": [{"lr": 0.5, "betas": (0.8, 0.9), "params": list(names)}],
    }


def _model() -> dict[str, torch.Tensor]:
    return {"a.weight": torch.ones(2, 3), "b.weight": torch.zeros(2, 3), "b.mean": torch.ones(3)}


def _read(path: Path, **kw: Any) -> Any:
    named = read_dcp_training_state(path, buffers={"b.mean"}, **kw)
    out = torch.empty(6)
    named.optimizer_state["exp_avg"]["b.weight"].read(out)
    return named, out


def test_the_dcp_tutorials_layout(tmp_path: Path) -> None:
    # `{"app": AppState}` whose state_dict is {"model": ..., "optim": ...}.
    app = {"model": _model(), "optim": _optimizer((3.0, 3.0), ("a.weight", "b.weight"))}
    path = _save({"app": app}, tmp_path / "c")
    named, moment = _read(path)
    assert set(named.masters) == {"a.weight", "b.weight"} and set(named.buffers) == {"b.mean"}
    assert named.step == 3  # no step entry: Adam's
    (group,) = named.param_groups
    assert group.names == ("a.weight", "b.weight") and group.scalars == {"step": 3.0}
    assert group.hyperparameters == {"lr": 0.5, "betas": (0.8, 0.9)}
    assert torch.equal(moment, torch.full((6,), 3.0))


def test_torchtitans_root_of_steps(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict import _flatten_optim_state_dict

    for step in (4, 12):
        flat = _flatten_optim_state_dict(_optimizer((step, step), ("a.weight", "b.weight")))
        train = {"step": step, "ntokens_seen": 7}
        _save({**_model(), "optimizer": flat, "train_state": train}, tmp_path / f"step-{step}")
    assert is_dcp_checkpoint(tmp_path) and is_dcp_checkpoint(tmp_path, step=4)
    assert not is_dcp_checkpoint(tmp_path, step=5)
    named, moment = _read(tmp_path)  # the newest
    assert named.step == 12 and torch.equal(moment, torch.full((6,), 12.0))
    assert set(named.masters) == {"a.weight", "b.weight"}
    assert any("'train_state' (ntokens_seen)" in n for n in named.not_carried)
    assert _read(tmp_path, step=4)[0].step == 4


def test_refusals(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a PyTorch DCP checkpoint"):
        read_dcp_training_state(tmp_path)
    uneven = _optimizer((3.0, 2.0), ("a.weight", "b.weight"))
    path = _save({"model": _model(), "optimizer": uneven}, tmp_path / "uneven")
    with pytest.raises(CheckpointError, match="stepped a different number of times"):
        read_dcp_training_state(path)
    two = {"model": _model(), "optimizer": _optimizer((1.0, 1.0), ("a.weight", "b.weight"))}
    two["optim"] = two["optimizer"]
    path = _save(two, tmp_path / "two")
    with pytest.raises(CheckpointError, match=r"several names \['optim\.', 'optimizer\.'\]"):
        read_dcp_training_state(path)
    with pytest.raises(CheckpointError, match="is one DCP checkpoint"):
        read_dcp_training_state(path, step=3)


class _Touch:
    """Unpickling this runs `touch PATH` through os.system."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.path}",)


def test_a_crafted_value_is_not_run(tmp_path: Path) -> None:
    # DCP pickles non-tensor entries (here the step) with torch.save: read weights-only.
    marker = tmp_path / "pwned"
    path = _save({"model": _model(), "step": _Touch(str(marker))}, tmp_path / "c")
    with pytest.raises(UnsafePickleError, match=r"posix\.system"):
        read_dcp_training_state(path)
    assert not marker.exists()
