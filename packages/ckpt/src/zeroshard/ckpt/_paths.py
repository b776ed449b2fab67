"""Names inside a checkpoint root: step directories, the `latest` pointer, temp names.

A root holds committed checkpoints (`step-{N}` or a tag), each with `metadata.json`,
and a `latest` file naming the newest one. Names starting with '.' are work in
progress (`.{name}.tmp`) or a checkpoint being replaced (`.{name}.old`); they never
count as checkpoints.

`latest` holds the name on its first line and, on its second, `crc32:{digest}` of that
name, so that a damaged pointer (a flipped bit that names another, older checkpoint;
a file filled with zeros) is told from a good one. A pointer of one line (written
before the checksum) is read as it is.
"""

from __future__ import annotations

import operator
import os
import shutil
import zlib
from pathlib import Path

from zeroshard.ckpt._errors import CheckpointError, ChecksumError, MissingShardError
from zeroshard.ckpt._stfile import fsync_dir

LATEST = "latest"
METADATA = "metadata.json"
_LATEST_CHECKSUM = "crc32:"


def checkpoint_step(step: object) -> int:
    """`step` as an int (anything with `__index__`: an int, a NumPy or 0-d tensor integer);
    CheckpointError for a bool, a float, a string or a negative number."""
    if type(step).__name__ in ("bool", "bool_"):
        raise CheckpointError(f"step must be an integer, got the bool {step!r}")
    try:
        value = operator.index(step)  # type: ignore[arg-type]
    except TypeError:
        raise CheckpointError(
            f"step must be an integer, got {type(step).__name__} {step!r}"
        ) from None
    if value < 0:
        raise CheckpointError(f"step must be >= 0, got {value}")
    return value


def step_of_name(name: str) -> int | None:
    """N for a checkpoint named 'step-N', else None (a tag)."""
    num = name.removeprefix("step-")
    return int(num) if name.startswith("step-") and num.isdigit() else None


def checkpoint_name(step: int, tag: str | None = None) -> str:
    """The directory name of a checkpoint: the tag if given, else 'step-{step}'."""
    if tag is None:
        return f"step-{checkpoint_step(step)}"
    if not tag or tag.startswith(".") or "/" in tag or "\\" in tag or tag == LATEST:
        raise CheckpointError(f"bad checkpoint tag {tag!r}: no '/', no leading '.', not 'latest'")
    return tag


def temp_dir(root: Path, name: str) -> Path:
    """Where a checkpoint is written before its commit renames it into place."""
    return root / f".{name}.tmp"


def old_dir(root: Path, name: str) -> Path:
    """Where a checkpoint being overwritten waits until its replacement is in place."""
    return root / f".{name}.old"


def read_latest(root: Path) -> str | None:
    """The checkpoint name the `latest` pointer holds, or None if there is none;
    ChecksumError if the pointer is damaged, CheckpointError if it names no checkpoint
    of this root."""
    path = root / LATEST
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    name = _pointer_name(data, path)
    # `latest` names a directory of this root; anything else would read or (through
    # overwrite and remove) touch files outside it.
    if name.startswith((".", "/", "\\")) or "/" in name or "\\" in name or name == LATEST:
        raise CheckpointError(
            f"{path} holds {name!r}, which is not a checkpoint name of this root "
            "(an absolute path, '..' or a hidden name); fix or delete that file"
        )
    return name


def _pointer_name(data: bytes, path: Path) -> str:
    """The name a `latest` file's bytes hold; ChecksumError if they are damaged."""
    try:
        lines = data.decode().split("\n")
    except UnicodeDecodeError:
        raise ChecksumError(f"{path} is damaged (not UTF-8 text): {data[:40]!r}") from None
    name = lines[0].strip()
    if len(lines) > 1 and lines[1]:  # the checksum line (a one-line pointer has none)
        digest = f"{zlib.crc32(lines[0].encode()):08x}"
        if lines[1] != _LATEST_CHECKSUM + digest or any(lines[2:]):
            raise ChecksumError(
                f"{path} is damaged: it holds {data[:80]!r}, whose checksum does not match"
            )
    if not name or not name.isprintable():
        raise ChecksumError(f"{path} is damaged: it holds {data[:40]!r}, not a checkpoint name")
    return name


def write_latest(root: Path, name: str) -> None:
    """Point `latest` at `name` atomically: write a temp file, fsync, rename, fsync the dir."""
    tmp = root / f".{LATEST}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{name}\n{_LATEST_CHECKSUM}{zlib.crc32(name.encode()):08x}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    fsync_dir(root)


def list_checkpoints(root: str | os.PathLike[str]) -> list[str]:
    """Committed checkpoint names under `root`, steps in numeric order, then tags."""
    root = Path(root)

    def order(name: str) -> tuple[int, int, str]:
        step = step_of_name(name)
        return (0, step, "") if step is not None else (1, 0, name)

    if not root.is_dir():
        return []
    names = [
        p.name
        for p in root.iterdir()
        if not p.name.startswith(".") and p.is_dir() and (p / METADATA).is_file()
    ]
    return sorted(names, key=order)


def resolve(path: Path, tag: str | None = None, step: int | None = None) -> Path:
    """The checkpoint directory meant by `path` (a checkpoint, or a root) and a tag or step.

    With neither tag nor step, a root resolves through `latest`. If `latest` names a
    checkpoint that an interrupted overwrite had moved aside, the moved copy is used.
    """
    path = Path(path)
    if tag is not None or step is not None:
        if tag is not None and step is not None:
            raise CheckpointError("give a tag or a step, not both")
        name = checkpoint_name(step if step is not None else 0, tag)
        target = path / name
        if not (target / METADATA).is_file():
            known = ", ".join(list_checkpoints(path)) or "none"
            raise MissingShardError(f"no checkpoint {name!r} under {path} (found: {known})")
        return target
    if (path / METADATA).is_file():
        return path
    latest = read_latest(path)
    if latest is None:
        if not path.exists():
            raise MissingShardError(f"{path} does not exist")
        raise CheckpointError(
            f"{path} is not a zeroshard checkpoint: it has neither {METADATA} nor a "
            f"'{LATEST}' pointer"
        )
    for candidate in (path / latest, old_dir(path, latest)):
        if (candidate / METADATA).is_file():
            return candidate
    raise MissingShardError(f"{path}/{LATEST} names {latest!r}, which has no {METADATA}")


def remove_checkpoint(root: str | os.PathLike[str], name: str) -> None:
    """Delete a committed checkpoint (not the one `latest` names), atomically to readers.

    It is first renamed to a '.'-prefixed name, so a crash part way through deleting
    never leaves a visible checkpoint with some of its files gone.
    """
    root = Path(root)
    if name == read_latest(root):
        raise CheckpointError(f"{root / name} is the latest checkpoint; refusing to remove it")
    target = root / checkpoint_name(0, name)
    if not (target / METADATA).is_file():
        raise MissingShardError(f"no checkpoint {name!r} under {root}")
    doomed = root / f".{name}.del-{os.getpid()}"
    os.rename(target, doomed)
    fsync_dir(root)
    shutil.rmtree(doomed)


def is_zeroshard_checkpoint(path: Path, tag: str | None = None, step: int | None = None) -> bool:
    """True if `path` is a zeroshard checkpoint, or a root holding one (any tag or step)."""
    if (path / METADATA).is_file() or list_checkpoints(path):
        return True
    name = checkpoint_name(step or 0, tag) if (tag or step is not None) else read_latest(path)
    if name is None:
        return False
    return any((d / METADATA).is_file() for d in (path / name, old_dir(path, name)))


def check_output_apart(src: str | os.PathLike[str], out: str | os.PathLike[str]) -> None:
    """Refuse an output that is, holds or lies inside the source (symlinks followed).

    Consolidating into the checkpoint (or a folder that holds it) with overwrite would
    replace the very files being read: checked before anything is read or written.
    """
    s, o = Path(src).resolve(), Path(out).resolve()
    if o == s or o.is_relative_to(s) or s.is_relative_to(o):
        where = "is" if o == s else "lies inside" if o.is_relative_to(s) else "contains"
        raise CheckpointError(
            f"output {out} {where} the source {src} (resolved: {o} vs {s}); "
            "choose an output outside the checkpoint"
        )
