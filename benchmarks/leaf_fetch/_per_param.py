"""The per-parameter peer of benchmarks/leaf_fetch: each parameter sharded and gathered alone.

This is what a per-tensor ZeRO-3 engine does for a module: every parameter has its own
even shard (zero-padded to a multiple of the world size), kept resident in the compute
dtype; fetching a module issues one all-gather per parameter into that parameter's
gathered buffer, then waits for each and points the parameter at its view; releasing
resizes each gathered buffer's storage to zero and points the parameter at an empty
tensor. Everything a real implementation would keep is made once here (shards,
gathered-buffer tensors, their views, labels, the empty tensor), so the timed loop does
only the per-parameter work: no extra syncs, no allocation but the storage resizes the
engine does too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from zeroshard.comm import Group


class PerParameterGather:
    """Fetch and release a list of parameters one all-gather each (see the module doc)."""

    def __init__(
        self,
        named: Sequence[tuple[str, nn.Parameter]],
        group: Group,
        dtype: torch.dtype,
    ) -> None:
        world, rank = group.size, group.rank
        self.group = group
        self.params = [p for _, p in named]
        self.labels = [f"gather of {n}" for n, _ in named]
        self.shards: list[torch.Tensor] = []
        self.buffers: list[torch.Tensor] = []
        self.views: list[torch.Tensor] = []
        self.nbytes: list[int] = []
        device = group.device
        with torch.no_grad():
            for _, p in named:
                numel = p.numel()
                part = -(-numel // world)
                flat = p.detach().reshape(-1)[rank * part : (rank + 1) * part]
                shard = torch.zeros(part, dtype=dtype, device=device)
                shard[: flat.numel()].copy_(flat)
                buffer = torch.empty(part * world, dtype=dtype, device=device)
                self.shards.append(shard)
                self.buffers.append(buffer)
                # Views are made once: they stay valid across storage resizes.
                self.views.append(buffer[:numel].view(p.shape))
                self.nbytes.append(buffer.numel() * buffer.element_size())
        self.empty = torch.empty(0, dtype=dtype, device=device)
        self.release()

    @property
    def gathered_bytes(self) -> int:
        """Bytes of all gathered buffers together (padding included)."""
        return sum(self.nbytes)

    def fetch(self) -> None:
        """One all-gather per parameter, all issued before any wait; then expose each."""
        handles = []
        for buffer, shard, nbytes, label in zip(
            self.buffers, self.shards, self.nbytes, self.labels, strict=True
        ):
            buffer.untyped_storage().resize_(nbytes)
            handles.append(self.group.all_gather_into(buffer, shard, label=label))
        for handle, p, view in zip(handles, self.params, self.views, strict=True):
            handle.wait()
            p.data = view

    def release(self) -> None:
        """Free every gathered buffer's memory; parameters point at an empty tensor."""
        for buffer, p in zip(self.buffers, self.params, strict=True):
            # Stream-ordered free: the caching allocator reuses the block only for work
            # queued after this point on the current stream, which waited for the gather.
            buffer.untyped_storage().resize_(0)
            p.data = self.empty
