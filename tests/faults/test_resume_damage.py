"""`resume_checkpoint` gives up no intact checkpoint: any damage to any file of the
newest one makes every rank take the newest intact one (by step, whatever it is named),
with one warning naming what was skipped and why; checkpoints that all fail to load
are an error, never a fresh start; a root that does not exist is a fresh start, logged
without a warning."""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks
from tests._logs import logged
from tests.faults._engine import assert_same_bits, build, train_step
from zeroshard.ckpt import CheckpointError

RANK0 = "rank00000.safetensors"
RANK1 = "rank00001.safetensors"
METADATA = "metadata.json"


def _flip(path: Path, at: int, bit: int = 0x04) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= bit
    path.write_bytes(bytes(data))


def _truncate(path: Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


def _lr_bit(root: Path) -> None:
    """lr 0.001 -> 0.003: one flipped bit of metadata.json, still valid JSON."""
    meta = root / "step-3" / "metadata.json"
    _flip(meta, meta.read_bytes().index(b'"lr":0.001') + len(b'"lr":0.00'), 0x02)


def _latest_names_step1(root: Path) -> None:
    """'step-3' -> 'step-1': one flipped bit of the pointer names an older checkpoint."""
    _flip(root / "latest", (root / "latest").read_bytes().index(b"3"), 0x02)


Damage = Callable[[Path], None]
# (what, root copied, its damage, the step resume must return, words of its warning).
# The root "steps" holds step-1, step-2 and step-3 (`latest`); "tagged" holds step-1,
# step-2 and the tag "best" at step 3 (`latest`).
CASES: list[tuple[str, str, Damage, int, str]] = [
    ("rank 0 cut", "steps", lambda r: _truncate(r / "step-3" / RANK0, 200), 2, "bytes"),
    ("rank 0 emptied", "steps", lambda r: _truncate(r / "step-3" / RANK0, 0), 2, "0 bytes"),
    ("rank 0 header bit", "steps", lambda r: _flip(r / "step-3" / RANK0, 20), 2, "crc32"),
    ("rank 1 data bit", "steps", lambda r: _flip(r / "step-3" / RANK1, -3), 2, "crc32"),
    ("no metadata", "steps", lambda r: (r / "step-3" / METADATA).unlink(), 2, "no metadata"),
    ("metadata lr bit", "steps", _lr_bit, 2, "crc32"),
    (
        "metadata not UTF-8",
        "steps",
        lambda r: _flip(r / "step-3" / METADATA, 30, 0x80),
        2,
        "damaged",
    ),
    ("metadata cut", "steps", lambda r: _truncate(r / "step-3" / METADATA, 90), 2, "damaged"),
    ("latest gone", "steps", lambda r: (r / "latest").unlink(), 3, ""),
    ("latest zeros", "steps", lambda r: (r / "latest").write_bytes(b"\0" * 8), 3, "latest"),
    ("latest names step-1", "steps", _latest_names_step1, 3, "checksum"),
    (
        "overwrite killed mid-way",
        "steps",
        lambda r: (r / "step-3").rename(r / ".step-3.old"),
        3,
        "",
    ),
    ("tag, latest gone", "tagged", lambda r: (r / "latest").unlink(), 3, ""),
    ("tag damaged", "tagged", lambda r: _flip(r / "best" / RANK1, -3), 2, "best"),
    ("tag without metadata", "tagged", lambda r: (r / "best" / METADATA).unlink(), 2, "best"),
]


def _on_rank0(fn: Callable[[], object]) -> None:
    if dist.get_rank() == 0:
        fn()
    dist.barrier()


def _resume_damage(base_s: str) -> None:
    base = Path(base_s)
    rank = dist.get_rank()
    model, opt = build(3)
    saved: dict[int, dict[str, torch.Tensor]] = {}
    for step in (1, 2, 3):
        train_step(model, opt, step)
        zs.save_checkpoint(model, opt, base / "steps", step=step, client_state={"step": step})
        tag = "best" if step == 3 else None
        zs.save_checkpoint(
            model, opt, base / "tagged", step=step, tag=tag, client_state={"step": step}
        )
        saved[step] = zs.full_state_dict(model)
    train_step(model, opt, 4)  # the live model differs from every checkpoint

    def resume(root: Path, want: int | None) -> list[str]:
        data: dict[str, object] = {"step": None}
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = zs.resume_checkpoint(model, opt, root, client_state=data)
        assert got == want and data["step"] == want, (got, data)
        if want is not None:
            assert_same_bits(zs.full_state_dict(model), saved[want])
        said = [str(w.message) for w in seen if "resume" in str(w.message)]
        assert rank == 0 or not said, said  # quiet on the other ranks
        return said

    def damaged(name: str, which: str, damage: Damage, want: int, words: str) -> None:
        root = base / name.replace(" ", "_")
        _on_rank0(lambda: (shutil.copytree(base / which, root), damage(root)))
        said = resume(root, want)
        if rank == 0:
            if words:  # one warning, naming what was skipped and why
                assert len(said) == 1 and words in said[0], said
                assert "skipping" in said[0] and f"Resumed from {root}" in said[0], said
            else:
                assert not said, said

    keys = ("name", "which", "damage", "want", "words")
    run_each([dict(zip(keys, case, strict=True)) for case in CASES], damaged)

    def every_one_damaged() -> None:
        root = base / "all_damaged"
        _on_rank0(lambda: shutil.copytree(base / "steps", root))
        for name in ("step-1", "step-2", "step-3"):
            _on_rank0(lambda name=name: _flip(root / name / RANK1, -3))
        with pytest.raises(CheckpointError, match=r"every checkpoint under .* is damaged"):
            resume(root, None)

    def missing_and_empty_roots() -> None:
        # The first run of every job: logged, no warning (it was one on every first run).
        with logged() as lines:
            assert not resume(base / "mistyped", None)
        if rank == 0:
            assert lines == [f"resume: {base / 'mistyped'} does not exist: starting from step 0"]
        else:
            assert lines == []
        _on_rank0(lambda: (base / "empty").mkdir())
        assert not resume(base / "empty", None)

    run_each([{}], every_one_damaged)
    run_each([{}], missing_and_empty_roots)


def test_resume_skips_every_kind_of_damage(tmp_path: Path) -> None:
    """Rank files truncated, emptied or flipped (rank 0's header too); metadata.json
    gone, flipped, not UTF-8, truncated; `latest` gone, zeroed or flipped to name an
    older step; an overwrite killed between its renames (`latest` names the moved copy);
    a tag as `latest`, gone or damaged: every rank resumes from the newest
    intact checkpoint, bit-identical, with one warning on rank 0. All damaged: an error.
    A root that does not exist: an INFO line naming it, no warning."""
    run_ranks(_resume_damage, 2, str(tmp_path), timeout_s=240)
