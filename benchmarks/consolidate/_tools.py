"""Run a consolidation tool as a subprocess and measure it: wall time with fsync of its
output, peak RSS, disk reads; and control the page cache around it."""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Run:
    """One subprocess run: exit status, wall seconds (with fsync), peak RSS, output."""

    rc: int
    seconds: float
    sync_seconds: float
    peak_rss: int
    read_bytes: int
    out_bytes: int
    log: str


def files(path: Path) -> list[Path]:
    """Every file under `path` (none if it does not exist)."""
    return [p for p in path.rglob("*") if p.is_file()] if path.exists() else []


def sync(paths: list[Path]) -> None:
    """fsync every file."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def evict(paths: list[Path]) -> None:
    """Drop the files from the page cache (no root needed), so the next read is from disk."""
    # Clean pages only: sync first so nothing dirty stays behind.
    sync(paths)
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(paths: list[Path]) -> None:
    """Read every file once, so that the warm runs find the input in the page cache."""
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass


def run_tool(cmd: list[str], out: Path, env: dict[str, str]) -> Run:
    """Run `cmd`, fsync what it wrote under `out`; time, peak RSS (KiB -> bytes), size."""
    log = out.parent / f"{out.name}.log"
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    ran = time.perf_counter() - start
    written = files(out)
    sync_start = time.perf_counter()
    sync(written)
    synced = time.perf_counter() - sync_start
    return Run(
        rc=proc.returncode,
        seconds=ran + synced,
        sync_seconds=synced,
        peak_rss=usage.ru_maxrss * 1024,
        read_bytes=usage.ru_inblock * 512,
        out_bytes=sum(p.stat().st_size for p in written),
        log=log.read_text(errors="replace"),
    )


def failure(run: Run) -> str:
    """The telling line of a failed run's log (the error, not the traceback's last hint)."""
    lines = [ln.strip() for ln in run.log.splitlines() if ln.strip()]
    for key in ("share memory", "Error:"):
        hits = [ln for ln in lines if key in ln]
        if hits:
            return hits[-1][:200]
    return lines[-1][:200] if lines else f"exit status {run.rc}"
