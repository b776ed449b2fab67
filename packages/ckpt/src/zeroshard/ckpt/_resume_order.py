"""`resume_order`: the checkpoints of a root a restart should try, best first.

[Note: the resume order]
`latest` names the newest committed checkpoint, so it is tried first. A checkpoint the
pointer does not name may be newer (a save killed between its commit rename and the
pointer update) or belong to a timeline left behind (a run rolled back to an older
checkpoint saves over it, and its later steps stay on disk): so after `latest` come
only those whose step (from their own `metadata.json`, whatever they are named: a tag
has a step too) is at most the step of `latest`, newest first. When `latest` is
missing or damaged nothing tells the timelines apart, and every checkpoint is a
candidate, newest step first. A checkpoint whose `metadata.json` is damaged or missing
is not a candidate: it is reported as skipped, with the reason, and so is a damaged
pointer. No collectives: the engine has one rank compute the order and share it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from zeroshard.ckpt._errors import CheckpointError, ChecksumError, MissingShardError
from zeroshard.ckpt._keys import RANK_FILE_GLOB
from zeroshard.ckpt._paths import LATEST, METADATA, old_dir, read_latest, step_of_name
from zeroshard.ckpt._reader import read_meta


@dataclass(frozen=True)
class ResumeOrder:
    """What a restart finds under a root: whether the root `exists`, the `candidates`
    (directory names under it) to try in order, and what was `skipped` as damaged
    before any load, as (what, why) pairs."""

    exists: bool
    candidates: tuple[str, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()

    def to_json(self) -> str:
        """The order as JSON text (to share it between ranks)."""
        return json.dumps(
            {"exists": self.exists, "candidates": self.candidates, "skipped": self.skipped}
        )

    @staticmethod
    def from_json(text: str) -> ResumeOrder:
        """Read `to_json()` output."""
        d = json.loads(text)
        return ResumeOrder(
            bool(d["exists"]),
            tuple(str(c) for c in d["candidates"]),
            tuple((str(a), str(b)) for a, b in d["skipped"]),
        )


def _looks_like_checkpoint(path: Path) -> bool:
    return step_of_name(path.name) is not None or any(path.glob(RANK_FILE_GLOB))


def resume_order(root: str | os.PathLike[str]) -> ResumeOrder:
    """The checkpoints under `root` to try on a restart, best first, and those skipped
    as damaged: see [Note: the resume order]."""
    root = Path(root)
    if not root.exists():
        return ResumeOrder(exists=False)
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory: it cannot hold checkpoints")
    skipped: list[tuple[str, str]] = []
    try:
        latest = read_latest(root)
    except ChecksumError as e:
        latest = None
        skipped.append((str(root / LATEST), str(e)))
    steps: dict[str, int | None] = {}
    for path in sorted(root.iterdir()):
        if path.name.startswith(".") or not path.is_dir():
            continue
        if not (path / METADATA).is_file():
            if _looks_like_checkpoint(path):
                skipped.append((str(path), f"it has no {METADATA}"))
            continue
        try:
            steps[path.name] = read_meta(path).step
        except (ChecksumError, MissingShardError) as e:
            skipped.append((str(path), str(e)))
        except CheckpointError:  # intact but unreadable here (another format version):
            steps[path.name] = step_of_name(path.name)  # its load will say why
    first: list[str] = []
    newest: int | None = None
    if latest is not None:
        newest = step_of_name(latest)
        moved = old_dir(root, latest)  # an overwrite killed between its two renames
        if latest not in steps and (moved / METADATA).is_file():
            latest, steps[moved.name] = moved.name, newest
        if latest in steps:
            first, newest = [latest], steps.pop(latest)
        elif not any(what == str(root / latest) for what, _ in skipped):
            skipped.append((str(root / LATEST), f"it names {latest!r}, which is not there"))
    known = [(s, n) for n, s in steps.items() if s is not None and (newest is None or s <= newest)]
    # Newest step first; at one step a `step-N` before a tag, then by name.
    known.sort(key=lambda sn: (-sn[0], step_of_name(sn[1]) is None, sn[1]))
    unknown = sorted(n for n, s in steps.items() if s is None)
    return ResumeOrder(True, (*first, *(n for _, n in known), *unknown), tuple(skipped))
