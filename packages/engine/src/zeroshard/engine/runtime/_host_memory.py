"""Before offload allocates anything: can this host hold it?

[Note: host memory bound]
What a process may still allocate is the smaller of two bounds. The cgroup's: its
`memory.max` minus `memory.current` (cgroup v2; v1's `memory.limit_in_bytes` minus
`memory.usage_in_bytes`), the tightest over the cgroup and its ancestors, since a parent's
limit binds its children too. The kernel's: `MemAvailable` of /proc/meminfo. `MemTotal`
is not used: on some GPU hosts it grows as memory is used, so it understates the limit.
A rank that would not fit raises before the first host buffer exists, instead of an OOM
kill an hour into loading. Ranks on one host (the same host name) share its memory: each
host must hold its ranks' bytes together. Every rank raises the same error (one
all-gather of each rank's host, bytes needed and headroom), so none waits in a
collective for a dead peer.
"""

from __future__ import annotations

import hashlib
import socket
from dataclasses import dataclass
from pathlib import Path

import torch

from zeroshard.comm import Group

# Where the bounds are read; module attributes so a test can point them at fixture files.
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_MEMINFO = Path("/proc/meminfo")

GIB = 1024**3


@dataclass(frozen=True)
class HostMemory:
    """Bytes this process may still allocate, and which bound gave the number."""

    available: int
    source: str


def _read_int(path: Path) -> int | None:
    """An integer file's value; None where it is absent or says `max` (no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text == "max" else int(text)


def _cgroup_dirs(self_cgroup: str, root: Path) -> list[tuple[Path, str, str]]:
    """(directory, limit file, usage file) of this process's memory cgroup and its
    ancestors, for v2 (`0::/path`) and v1 (`N:memory:/path`) lines."""
    out: list[tuple[Path, str, str]] = []
    for line in self_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            base, limit, usage = root, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            base, limit, usage = root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        rel = Path(path.lstrip("/"))
        for d in (rel, *rel.parents):
            out.append((base / d, limit, usage))
    return out


def read_host_memory(
    self_cgroup: Path = PROC_SELF_CGROUP,
    cgroup_root: Path = CGROUP_ROOT,
    meminfo: Path = PROC_MEMINFO,
) -> HostMemory:
    """The smaller of the cgroup's headroom and MemAvailable ([Note: host memory bound])."""
    best = HostMemory(-1, "")
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            best = HostMemory(int(line.split()[1]) * 1024, f"MemAvailable of {meminfo}")
    try:
        lines = self_cgroup.read_text()
    except OSError:
        lines = ""
    for d, limit_file, usage_file in _cgroup_dirs(lines, cgroup_root):
        limit, usage = _read_int(d / limit_file), _read_int(d / usage_file)
        # cgroup v1 writes "no limit" as a huge number: min() below leaves it out.
        if limit is None or usage is None:
            continue
        headroom = max(0, limit - usage)
        if best.available < 0 or headroom < best.available:
            best = HostMemory(headroom, f"{d / limit_file} minus {usage_file}")
    if best.available < 0:
        raise RuntimeError(f"cannot tell the host's free memory: no MemAvailable in {meminfo}")
    return best


def _host_id() -> int:
    """This host's name as a non-negative int64: ranks with equal ids share its memory."""
    digest = hashlib.blake2b(socket.gethostname().encode(), digest_size=7).digest()
    return int.from_bytes(digest, "little")


def check_host_memory(world: Group, per_rank: int, what: str) -> None:
    """Raise the same MemoryError on every rank if any host cannot hold `per_rank` bytes
    for each of its ranks (one all-gather of host, bytes and headroom per rank)."""
    mem = read_host_memory(PROC_SELF_CGROUP, CGROUP_ROOT, PROC_MEMINFO)
    rows = [[_host_id(), per_rank, mem.available]]
    if world.size > 1:
        mine = torch.tensor(rows[0], dtype=torch.int64, device=world.device)
        recv = torch.empty(3 * world.size, dtype=torch.int64, device=world.device)
        world.all_gather_into(recv, mine, label="initialize: host memory").wait()
        rows = recv.view(world.size, 3).tolist()
    local = [sum(1 for other in rows if other[0] == row[0]) for row in rows]
    short = [
        (r, n * k, a, k)
        for r, ((_, n, a), k) in enumerate(zip(rows, local, strict=True))
        if n * k > a
    ]
    if not short:
        return
    detail = "; ".join(
        f"rank {r} needs {n:,} bytes ({n / GIB:.1f} GiB) for the {k} ranks of its host, "
        f"{a:,} ({a / GIB:.1f} GiB) available"
        for r, n, a, k in short
    )
    raise MemoryError(
        f"offload: the host cannot hold {what}, {per_rank:,} bytes per rank: {detail}. "
        f"This rank read {mem.source}. Offload a smaller share (offload_ratio), use more "
        "hosts, or free host memory."
    )
