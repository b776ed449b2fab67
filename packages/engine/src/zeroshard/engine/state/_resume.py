"""`resume_checkpoint`: on (re)start, load the newest intact checkpoint, if any.

[Note: resuming after a crash]
Saves are atomic (see [Note: commit protocol] in zeroshard.ckpt), so what a killed job
leaves behind is at worst a '.'-prefixed temp folder, which is never a checkpoint, or a
committed checkpoint that `latest` does not name yet (killed between the rename and the
pointer update). Rank 0 lists the candidates (zeroshard.ckpt's `resume_order`: `latest`
first, then by the step their metadata records, newest first; see [Note: the resume
order]) and every rank gets that list, so every rank tries the same checkpoints in the
same order. A checkpoint damaged after its commit (a rank file lost, truncated or
flipped; its metadata damaged) fails its load on every rank alike (`load_checkpoint`
agrees on one outcome), so every rank goes on to the same next one; what was skipped is
said in one warning. Other errors (another model, another optimizer, per-rank state at
another world size) are the caller's to see and are raised, not skipped. When
checkpoints exist and none loads, resuming raises rather than starting fresh: a run from
step 0 would go on saving over the only record of the old one, which someone may still
repair. A root that does not exist is a fresh start, logged (INFO, rank 0) with its
absolute path: the first run of every job starts so, and a warning there would be noise
every user learns to ignore; the line says which folder a mistyped path pointed at.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import torch

from zeroshard.ckpt import (
    CHECKPOINT_ERRORS,
    CheckpointError,
    ChecksumError,
    MissingShardError,
    ResumeOrder,
    resume_order,
)
from zeroshard.comm import Agreement, agreed, is_rank0, warn_on_rank0
from zeroshard.engine.runtime._state import EngineModel, engine_module, engine_state
from zeroshard.engine.state._checkpoint import (
    call_fields,
    check_same_call,
    every_rank,
    load_checkpoint,
)

log = logging.getLogger("zeroshard.engine")


def _skipped_text(skipped: list[tuple[str, str]]) -> str:
    return "; ".join(
        f"skipping {'the pointer' if Path(what).name == 'latest' else 'checkpoint'} {what}, "
        f"which is damaged: {why}"
        for what, why in skipped
    )


def resume_checkpoint(
    model: EngineModel,
    optimizer: torch.optim.Optimizer | None,
    directory: str | os.PathLike[str],
    *,
    client_state: MutableMapping[str, Any] | None = None,
    rank_state: MutableMapping[str, Any] | None = None,
) -> int | None:
    """Load the newest intact checkpoint under the root `directory`; return its step,
    or None when there is none (a fresh start). Call on every rank.

    Tries `latest` first, then the other checkpoints by step, newest first, skipping
    those whose files are missing or damaged (one warning says which, and why): see
    [Note: resuming after a crash]. Raises `CheckpointError` when there are checkpoints
    and none loads; logs a fresh start when `directory` does not exist. `client_state` /
    `rank_state` are restored as by `load_checkpoint`.
    """
    root = Path(directory)
    everyone = every_rank(engine_state(engine_module(model)))
    call = f"resume_checkpoint({str(directory)!r})"
    fields = call_fields(None, client_state, rank_state)
    check_same_call(everyone, "resume_checkpoint", call, fields)
    ag = Agreement(everyone)
    label = f"{call}: the checkpoints"

    def listed() -> str:
        return resume_order(root).to_json() if ag.rank == 0 else ""

    order = ResumeOrder.from_json(
        ag.from_rank0(agreed(everyone, label, listed, CHECKPOINT_ERRORS), label)
    )
    if not order.exists:
        _log_fresh_start(root, "does not exist")
        return None
    skipped = list(order.skipped)
    for name in order.candidates:
        try:
            step = load_checkpoint(
                model, optimizer, root / name, client_state=client_state, rank_state=rank_state
            )
        except (MissingShardError, ChecksumError) as e:
            skipped.append((str(root / name), str(e)))
            continue
        if skipped:
            warn_on_rank0(f"resume: {_skipped_text(skipped)}. Resumed from {root / name}")
        return step
    if skipped:
        names = ", ".join(Path(what).name for what, _ in skipped)
        raise CheckpointError(
            f"resume: every checkpoint under {root} is damaged ({names}); not starting from "
            f"step 0 over them: repair them, or move them aside to start fresh. "
            f"{_skipped_text(skipped)}"
        )
    _log_fresh_start(root, "holds no checkpoint")
    return None


def _log_fresh_start(root: Path, why: str) -> None:
    if is_rank0():
        log.info("resume: %s %s: starting from step 0", os.path.abspath(root), why)
