"""Snapshot bytes between ranks: point-to-point over the snapshots' own gloo group.

[Note: the snapshots' process group]
Replication runs in a background thread while training issues its own collectives. On
one process group collectives must come in the same order on every rank, so the thread
never touches training's groups: `Snapshots` makes a gloo group of its own (host memory
travels over it with no device copy, whatever training's backend), used by the thread
while it runs, and by `resume` on the main thread before any thread starts.
A message is a small header (step, length) and then the bytes in chunks, each with its
own tag (gloo's messages are bounded in size).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

_CHUNK = 256 * 1024 * 1024
Works = list[dist.Work | None]


def send_header(pg: dist.ProcessGroup, values: Sequence[int], dst: int) -> Works:
    """Start sending a few integers to global rank `dst`."""
    return [dist.isend(torch.tensor(list(values), dtype=torch.int64), dst, group=pg, tag=0)]


def recv_header(pg: dist.ProcessGroup, n: int, src: int) -> tuple[torch.Tensor, Works]:
    """Start receiving `n` integers from global rank `src` (read them after `wait`)."""
    out = torch.empty(n, dtype=torch.int64)
    return out, [dist.irecv(out, src, group=pg, tag=0)]


def send_bytes(pg: dist.ProcessGroup, buf: torch.Tensor, dst: int) -> Works:
    """Start sending the uint8 tensor `buf` to global rank `dst`."""
    works: Works = []
    for k, i in enumerate(range(0, buf.numel(), _CHUNK)):
        works.append(dist.isend(buf[i : i + _CHUNK], dst, group=pg, tag=1 + k))
    return works


def recv_bytes(pg: dist.ProcessGroup, out: torch.Tensor, src: int) -> Works:
    """Start receiving into the uint8 tensor `out` (its length known) from `src`."""
    works: Works = []
    for k, i in enumerate(range(0, out.numel(), _CHUNK)):
        works.append(dist.irecv(out[i : i + _CHUNK], src, group=pg, tag=1 + k))
    return works


def wait(works: Works) -> None:
    """Wait for every started send and receive."""
    for w in works:
        if w is not None:
            w.wait()
