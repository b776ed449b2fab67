"""Every file of a checkpoint is covered by a checksum: no single flipped bit of
`metadata.json` or `latest` is read as different hyperparameters, a different step or
another checkpoint; and what the writer writes, the reader reads (a safetensors header
too big to read back is refused at save, before anything is written)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zeroshard.ckpt import (
    CheckpointError,
    CheckpointMeta,
    ChecksumError,
    GroupMeta,
    MissingShardError,
    RankExtra,
    list_checkpoints,
    load,
    read_latest,
    save,
)
from zeroshard.partition import FlatLayout

HYPERPARAMETERS = {"lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1}


def _meta() -> CheckpointMeta:
    layout = FlatLayout.build([("w", (3, 5)), ("b", (5,))], torch.float32, 1)
    kinds = {"master": torch.float32, "optim.exp_avg": torch.float32}
    group = GroupMeta("g", layout, kinds, scalars={"step": 4})
    return CheckpointMeta(1, (group,), param_groups=(HYPERPARAMETERS,), extra={"step": 4})


def _save(root: Path, step: int, extra: RankExtra | None = None) -> None:
    n = _meta().groups[0].layout.shard_numel
    tensors = {"g.master": torch.arange(n, dtype=torch.float32), "g.optim.exp_avg": torch.ones(n)}
    save(root, step, meta=_meta(), tensors=tensors, extra=extra)


def _flips(data: bytes) -> list[bytes]:
    out = []
    for i in range(len(data)):
        for bit in range(8):
            flipped = bytearray(data)
            flipped[i] ^= 1 << bit
            out.append(bytes(flipped))
    return out


def test_every_bit_flip_of_the_metadata_is_refused(tmp_path: Path) -> None:
    """Each of the 8 x len single-bit flips of a metadata.json fails its load with a
    ChecksumError; none loads other hyperparameters, scalars or another step."""
    root = tmp_path / "ck"
    _save(root, 4)
    meta_path = root / "step-4" / "metadata.json"
    good = meta_path.read_bytes()
    assert load(root, rank=0, world_size=1).meta.param_groups == (HYPERPARAMETERS,)
    loaded, other_errors = [], []
    for flipped in _flips(good):
        meta_path.write_bytes(flipped)
        try:
            got = load(root / "step-4", rank=0, world_size=1)
        except ChecksumError:
            continue
        except Exception as e:  # refused, but not as the damage it is
            other_errors.append(repr(e)[:120])
            continue
        loaded.append((got.meta.param_groups, got.meta.step, got.meta.groups[0].scalars))
    flips = 8 * len(good)
    assert loaded == [], f"{len(loaded)} of {flips} flips loaded: {loaded[:3]}"
    assert other_errors == [], f"{len(other_errors)} of {flips}: {other_errors[:3]}"


def test_every_bit_flip_of_latest_is_caught(tmp_path: Path) -> None:
    """No single flipped bit of `latest` names another existing checkpoint: the pointer
    is refused as damaged, or names none there is. Zeros are refused too."""
    root = tmp_path / "ck"
    for step in (1, 2, 3):
        _save(root, step)
    pointer = root / "latest"
    good = pointer.read_bytes()
    assert read_latest(root) == "step-3"
    resolved = []
    for flipped in _flips(good):
        pointer.write_bytes(flipped)
        try:
            name = read_latest(root)
        except ChecksumError:
            continue
        if name is not None and name in list_checkpoints(root):
            resolved.append(name)
    assert resolved == [], resolved
    pointer.write_bytes(b"\0" * len(good))
    with pytest.raises(ChecksumError, match="latest is damaged"):
        read_latest(root)
    pointer.write_bytes(good)
    with pytest.raises(MissingShardError):
        load(root, rank=0, world_size=1, step=7)
    assert load(root, rank=0, world_size=1).meta.step == 3


def test_the_reader_reads_what_the_writer_writes(tmp_path: Path) -> None:
    """Extra state making a header over the safetensors limit is refused before a byte is
    written; one just under the limit saves and reads back."""
    root = tmp_path / "ck"
    limit = 100_000_000  # the safetensors library's largest header
    with pytest.raises(CheckpointError, match=r"over the 100,000,000 a safetensors header"):
        _save(root, 1, RankExtra("x" * limit, {}))
    assert not root.exists()  # not even the root was made
    text = "y" * (limit - 10_000)
    _save(root, 2, RankExtra(text, {}))
    got = load(root, rank=0, world_size=1, extras={0})
    assert got.extras[0].text == text
