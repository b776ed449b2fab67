"""`resume_checkpoint`: on (re)start, load the newest complete checkpoint, if any.

[Note: resuming after a crash]
Saves are atomic (see [Note: commit protocol] in zeroshard.ckpt), so what a killed job
leaves behind is at worst a '.'-prefixed temp folder, which is never a checkpoint, or a
committed checkpoint that `latest` does not name yet (killed between the rename and the
pointer update): `latest` is tried first, so that one is skipped, never half-read. A
checkpoint damaged after its commit (a rank file lost or truncated) fails its load on
every rank alike (`load_checkpoint` agrees on one outcome), so every rank falls back to
the same older one. Other errors (another model, per-rank state at another world size)
are the caller's to see and are raised, not skipped. When checkpoints exist and every one
is damaged, resuming raises rather than starting fresh: a run from step 0 would go on
saving over the only record of the old one, which someone may still repair.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import torch

from zeroshard.ckpt import (
    CheckpointError,
    ChecksumError,
    MissingShardError,
    list_checkpoints,
    read_latest,
)
from zeroshard.comm import warn_on_rank0
from zeroshard.engine.runtime._state import EngineModel
from zeroshard.engine.state._checkpoint import load_checkpoint


def _step_of(name: str) -> int | None:
    num = name.removeprefix("step-")
    return int(num) if name.startswith("step-") and num.isdigit() else None


def resume_candidates(root: Path) -> list[str]:
    """Checkpoint names to try, best first: `latest`, then older steps, newest first."""
    latest = read_latest(root)
    steps = [n for n in list_checkpoints(root) if _step_of(n) is not None]
    if latest is None:
        return steps[::-1]
    newest = _step_of(latest)
    older = [n for n in steps[::-1] if newest is not None and (_step_of(n) or 0) < newest]
    return [latest, *older]


def resume_checkpoint(
    model: EngineModel,
    optimizer: torch.optim.Optimizer,
    directory: str | os.PathLike[str],
    *,
    client_state: MutableMapping[str, Any] | None = None,
    rank_state: MutableMapping[str, Any] | None = None,
) -> int | None:
    """Load the newest complete checkpoint under the root `directory`; return its step,
    or None when there is none (a fresh start). Call on every rank.

    Tries `latest` first, then older `step-N` checkpoints, newest first, skipping those
    whose files are missing or corrupt (with a warning): see [Note: resuming after a
    crash]. Raises `CheckpointError` when there are checkpoints and all are damaged.
    `client_state` / `rank_state` are restored as by `load_checkpoint`.
    """
    root = Path(directory)
    damaged = []
    for name in resume_candidates(root):
        try:
            return load_checkpoint(
                model,
                optimizer,
                root / name,
                client_state=client_state,
                rank_state=rank_state,
            )
        except (MissingShardError, ChecksumError) as e:
            warn_on_rank0(f"resume: skipping checkpoint {root / name}, which is damaged: {e}")
            damaged.append(name)
    if damaged:
        raise CheckpointError(
            f"resume: every checkpoint under {root} is damaged ({', '.join(damaged)}); not "
            "starting from step 0 over them: repair them, or move them aside to start fresh"
        )
    return None
