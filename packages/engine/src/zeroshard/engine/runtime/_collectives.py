"""The collectives of flat groups, in one place: the eager runtime (stage 3's gathers,
stages 1/2's publish, the reducer) and `zeroshard.compile`'s ops all call these.

[Note: collective streams]
The stream and event policy of every flat-group collective is this module's:
- Copy-in: the wire writes this rank's part of the gathered buffer, or the reducer its
  bucket, on the *current* stream (the compute stream), so it follows whatever produced
  the shard or the gradients there.
- The collective: `Group` issues it asynchronously on the process group's own stream
  (NCCL's), which first waits on the current stream ([Note: streams and memory] in
  zeroshard.comm): the copy-in is complete when it reads its input.
- Waiting: the caller waits the handle before reading the output; that makes the
  current stream wait on the collective, and keeps the tensors' memory from reuse
  until then (`record_stream` where the waiting stream is another).
A copy-in stream of its own (FSDP2's) would be a change made here alone.

[Note: in-place gather]
This rank's part of the gathered buffer is written straight by the wire, and the
all-gather runs in place (its input is that part, as FSDP2's): no send buffer is
allocated, and the collective does not copy this rank's own part again (NCCL skips it in
place; with one rank nothing is left to move).
"""

from __future__ import annotations

import torch

from zeroshard.comm import Group, Handle, ReduceOp
from zeroshard.engine.runtime._wire import Wire


def gather_shards(
    process_group: Group, wire: Wire, shard: torch.Tensor, buffer: torch.Tensor, *, label: str
) -> Handle:
    """Start the all-gather of every rank's shard into `buffer` (storage allocated, of
    `wire.dtype`), this rank's written from `shard` by `wire` ([Note: in-place gather])."""
    n = buffer.numel() // process_group.size
    mine = buffer[process_group.rank * n : (process_group.rank + 1) * n]
    wire.encode_into(mine, shard)
    return process_group.all_gather_into(buffer, mine, label=label)


def reduce_scatter_grads(
    process_group: Group,
    full: torch.Tensor,
    *,
    op: ReduceOp,
    in_place: bool,
    label: str,
) -> tuple[torch.Tensor, Handle]:
    """Start reducing `full` (a flat gradient buffer) over `process_group` by `op` into
    this rank's part of it (`in_place`), or else into a new shard-sized tensor; the
    shard and the handle to wait before reading it."""
    n = full.numel() // process_group.size
    if in_place:
        out = full[process_group.rank * n : (process_group.rank + 1) * n]
    else:
        out = torch.empty(n, dtype=full.dtype, device=full.device)
    return out, process_group.reduce_scatter(out, full, op=op, label=label)


def average_replicas(replicate: Group, shard: torch.Tensor, *, label: str) -> None:
    """Hybrid sharding: average a reduced gradient shard over the ranks that hold the
    same shard (in place, waited)."""
    replicate.all_reduce(shard, op="avg", label=label).wait()
