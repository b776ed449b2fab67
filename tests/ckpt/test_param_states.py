"""Whole-parameter optimizer state (format version 5): saved in its owner's rank file by
parameter name, read back bit for bit by any rank at any world size; a checkpoint without
any stays version 3, and what does not match the metadata is refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tests.ckpt._model import build, same_bits
from zeroshard.ckpt import (
    CheckpointError,
    CheckpointMeta,
    ParamState,
    load,
    param_state_key,
    save,
)

# A preconditioner (not shaped like the parameter), a bf16 momentum and a 0-d step.
STATE = {
    "block.0.weight": {
        "left": torch.randn(16, 16, generator=torch.Generator().manual_seed(1)),
        "momentum": torch.randn(16, 8, generator=torch.Generator().manual_seed(2)).bfloat16(),
        "step": torch.tensor(3.0),
    }
}


def _with_state(tmp_path: Path) -> tuple[Path, CheckpointMeta]:
    b = build(1, 3)
    states = {
        name: ParamState(
            0, {k: (t.dtype, tuple(t.shape), k != "step") for k, t in st.items()}, {"count": 2}
        )
        for name, st in STATE.items()
    }
    # version 0: the lowest that holds them, as a meta built afresh gets.
    meta = dataclasses.replace(b.meta, param_states=states, version=0)
    tensors = dict(b.ranks[0])
    tensors.update({param_state_key(n, k): t for n, st in STATE.items() for k, t in st.items()})
    save(tmp_path, 10, meta=meta, tensors=tensors)
    return tmp_path, meta


@pytest.mark.parametrize("world", [1, 3])
def test_param_states_round_trip_at_any_world_size(tmp_path: Path, world: int) -> None:
    root, meta = _with_state(tmp_path)
    assert meta.version == 5
    for rank in range(world):
        got = load(root, rank=rank, world_size=world, param_states=["block.0.weight"])
        saved = got.meta.param_states["block.0.weight"]
        assert saved.scalars == {"count": 2} and saved.tensors["step"][2] is False
        for key, want in STATE["block.0.weight"].items():
            assert same_bits(got.param_states["block.0.weight"][key], want), key
    # Asked for nothing, nothing is read.
    assert not load(root, rank=0, world_size=1).param_states


def test_a_checkpoint_without_param_states_stays_version_3(tmp_path: Path) -> None:
    b = build(1, 3)
    save(tmp_path, 10, meta=b.meta, tensors=b.ranks[0])
    text = (tmp_path / "step-10" / "metadata.json").read_text()
    assert '"version":3' in text.replace(" ", "") and "param_states" not in text


def test_missing_or_malformed_param_states_are_refused(tmp_path: Path) -> None:
    root, meta = _with_state(tmp_path)
    with pytest.raises(CheckpointError, match=r"no whole-parameter optimizer state for \['l2.w"):
        load(root, rank=0, world_size=1, param_states=["l2.weight"])
    d = json.loads((root / "step-10" / "metadata.json").read_text())
    d["version"] = 4
    with pytest.raises(CheckpointError, match="version 4 has no param states"):
        CheckpointMeta.from_dict(d)
    d["version"] = 5
    d["param_states"]["frozen.weight"] = d["param_states"].pop("block.0.weight")
    with pytest.raises(CheckpointError, match=r"'frozen\.weight', which is no trainable"):
        CheckpointMeta.from_dict(d)
    # A tensor whose shape the metadata does not say is refused at save, before writing.
    b = build(1, 3)
    tensors = dict(b.ranks[0])
    tensors.update(
        {param_state_key("block.0.weight", k): t for k, t in STATE["block.0.weight"].items()}
    )
    tensors[param_state_key("block.0.weight", "left")] = torch.zeros(4)
    with pytest.raises(CheckpointError, match=r"param state 'pstate\.block\.0\.weight/left' is"):
        save(tmp_path / "bad", 10, meta=meta, tensors=tensors)
