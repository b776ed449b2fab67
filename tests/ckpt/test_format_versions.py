"""Format version 1 checkpoints (before `rank_sets`) still load and consolidate; version 7
is the one whose rank sets may leave rank files out.

The fixture `fixtures/zeroshard_v1/` was written by `zs.save_checkpoint` before format
version 2 (2 ranks, stage 3, a Linear-Tanh-Linear model, AdamW, one step);
`zeroshard_v1-expected.safetensors` is the `full_state_dict` those ranks had.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from zeroshard.ckpt import CheckpointError, CheckpointMeta, consolidate, describe, load
from zeroshard.ckpt._keys import MASTER
from zeroshard.ckpt._reader import CheckpointReader

FIXTURE = Path(__file__).parent / "fixtures" / "zeroshard_v1"
EXPECTED = Path(__file__).parent / "fixtures" / "zeroshard_v1-expected.safetensors"


def test_v1_consolidates_to_what_the_ranks_had(tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    consolidate(FIXTURE, out)
    got, want = load_file(out), load_file(EXPECTED)
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
    assert "v1" in describe(FIXTURE).format


@pytest.mark.parametrize("world", [1, 3])
def test_v1_loads_at_another_world_size(world: int) -> None:
    want = load_file(EXPECTED)
    with CheckpointReader(FIXTURE) as reader:
        meta = reader.meta
    assert meta.version == 1 and all(g.rank_sets is None for g in meta.groups)
    for g in meta.groups:
        shards = [
            load(FIXTURE, rank=r, world_size=world).shard(g.name, MASTER) for r in range(world)
        ]
        flat = torch.cat(shards)
        for slot in g.layout.slots:
            value = flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
            torch.testing.assert_close(value, want[slot.name], rtol=0, atol=0, msg=slot.name)
        assert load(FIXTURE, rank=0, world_size=world).shard(g.name, "optim.exp_avg").numel()


def test_v1_metadata_with_rank_sets_is_refused() -> None:
    d = json.loads((FIXTURE / "step-1" / "metadata.json").read_text())
    assert CheckpointMeta.from_dict(d).version == 1
    d["groups"][0]["layout"]["world_size"] = 1
    d["groups"][0]["rank_sets"] = [[0], [1]]
    with pytest.raises(CheckpointError, match="version 1 has no rank sets"):
        CheckpointMeta.from_dict(d)
    d["version"] = 2
    meta = CheckpointMeta.from_dict(d)
    assert meta.groups[0].instances == 2 and meta.groups[0].file_rank(1, 0) == 1


def test_rank_sets_that_leave_files_out_are_version_7() -> None:
    d = json.loads((FIXTURE / "step-1" / "metadata.json").read_text())
    d["groups"][0]["rank_sets"] = [[0, 1]]  # every file holds it: as version 2 could say
    d["version"] = 2
    assert CheckpointMeta.from_dict(d).groups[0].holds(1)
    d["world_size"] = 4  # files 2 and 3 hold only the groups whose sets name them
    d["groups"] = d["groups"][:1]
    with pytest.raises(CheckpointError, match="version 2: every rank file holds every group"):
        CheckpointMeta.from_dict(d)
    d["version"] = 7
    meta = CheckpointMeta.from_dict(d)
    assert not meta.groups[0].holds(2) and list(meta.shard_keys(2)) == []
    assert dataclasses.replace(meta, version=0).version == 7  # written as the lowest
