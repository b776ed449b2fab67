"""`convert_to_dcp` read back by torch's own DCP reader: every tensor of a zeroshard
checkpoint (tied weight, frozen layer, an int64 buffer, two param groups' Adam state)
where FSDP2's `get_state_dict` puts it, bit for bit (the session's world-3 checkpoints:
tests/ckpt/conftest.py; FSDP2 loading and continuing: tests/engine/test_dcp_export.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.ckpt._model import HYPER, same_bits
from zeroshard.ckpt import CheckpointError, convert_to_dcp


def _torch_read(path: Path, tmp_path: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, tmp_path / "all.pt")
    out: dict[str, Any] = torch.load(tmp_path / "all.pt", weights_only=True)
    return out


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torch_reads_every_tensor_where_fsdp2_puts_it(world3: Path, tmp_path: Path) -> None:
    # What the ranks trained and saved (the reference they wrote beside the checkpoints).
    ref = load_file(str(world3 / "reference-s3.safetensors"))
    want = {k.removeprefix("sd."): v for k, v in ref.items() if k.startswith("sd.")}
    convert_to_dcp(world3 / "s3-async0", tmp_path / "dcp", workers=2)
    got = _torch_read(tmp_path / "dcp", tmp_path)
    assert got["step"] == 10
    model = got["model"]  # tied: both names; the frozen layer; BatchNorm's buffers
    assert set(model) == set(want)
    for name, value in want.items():
        assert same_bits(model[name], value), name
    state, groups = got["optimizer"]["state"], got["optimizer"]["param_groups"]
    trainable = {k.removeprefix("optim.exp_avg.") for k in ref if k.startswith("optim.exp_avg.")}
    assert set(state) == trainable  # tied once
    for name in trainable:
        assert state[name]["step"].dtype == torch.float32 and float(state[name]["step"]) == 3.0
        for key in ("exp_avg", "exp_avg_sq"):
            assert same_bits(state[name][key], ref[f"optim.{key}.{name}"]), (name, key)
    for saved, hyper in zip(groups, HYPER, strict=True):
        assert {k: v for k, v in saved.items() if k != "params"} == {
            **hyper,
            "betas": tuple(hyper["betas"]),  # torch's type, not JSON's list
        }
    assert sorted(n for g in groups for n in g["params"]) == sorted(trainable)


def test_refusals(world3: Path, tmp_path: Path) -> None:
    src = world3 / "s1-async0"
    with pytest.raises(ValueError, match="layout must be one of"):
        convert_to_dcp(src, tmp_path / "x", layout="megatron")  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match="lies inside the source"):
        convert_to_dcp(src, src / "dcp")
    with pytest.raises(CheckpointError, match=r"metadata\.json"):
        convert_to_dcp(tmp_path, tmp_path.parent / "elsewhere")
    assert not (tmp_path / "x").exists() and not (tmp_path.parent / "elsewhere").exists()
