"""The disk floor of one consolidation, measured with dd in the same run."""

from __future__ import annotations

import math
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.consolidate._tools import evict


@dataclass(frozen=True)
class Floor:
    """The disk floor of one consolidation, measured with dd in this run (seconds)."""

    write: float  # the output's bytes, written and fdatasynced
    cold_read: float  # the bytes consolidation must read, from the disk
    warm_read: float  # the same bytes, from the page cache

    @property
    def cold(self) -> float:
        """Cold floor: read what must be read from the disk, write the output."""
        return self.cold_read + self.write

    @property
    def warm(self) -> float:
        """Warm floor: read what must be read from the page cache, write the output."""
        return self.warm_read + self.write

    def of(self, mode: str) -> float:
        """The floor of `mode` ("cold" or "warm")."""
        return self.cold if mode == "cold" else self.warm


def _dd(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(["dd", *args, "bs=4M"], check=True, capture_output=True)
    return time.perf_counter() - start


def disk_floor(work: Path, out_bytes: int, read_bytes: int) -> Floor:
    """dd: write `out_bytes` (fdatasync), then read `read_bytes` of it cold, then warm."""
    path = work / "dd.bin"
    blocks = max(1, math.ceil(max(out_bytes, read_bytes) / (4 << 20)))
    write = _dd(["if=/dev/zero", f"of={path}", f"count={blocks}", "conv=fdatasync"])
    write *= out_bytes / (blocks * (4 << 20))
    reading = [f"if={path}", "of=/dev/null", f"count={max(1, math.ceil(read_bytes / (4 << 20)))}"]
    evict([path])
    cold = _dd(reading)
    warm = _dd(reading)
    path.unlink()
    return Floor(write, cold, warm)
