"""The compute-dtype shards of offloaded groups, rewritten from their fp32 masters.

[Note: offload upload slots]
After a step (or any change of the masters) the compute shards are rewritten chunk by
chunk ([Note: offload stream order] in _offload.py). `begin` names the chunk-space
ranges that will change; `written(lo, hi)` says that the masters of [lo, hi) are final,
and casts them at once, while the step that just wrote them has them in cache ([Note:
blocked host step]): straight into the host shards with offload_params, else into a
pinned slot the chunk holds until all of it is final, when the H2D stream copies the slot
to the device. A chunk's parts that no named range covers (frozen groups, padding) are
cast when it completes.

There are `UPLOAD_SLOTS` slots. A chunk takes one when its first range is written: a
free one, else the one whose copy went up longest ago, after that copy completed. If
every slot holds a chunk still incomplete (groups stepped out of order, as under
`step_in_backward`), the chunk opened first gives its slot up: it is then cast whole
from the masters when it completes, as every chunk was before this pass structure. The
bits are the same either way: a cast of the same fp32 value.

[Note: upload stream order]
A chunk's copy overwrites the device shard that gathers and the publish read. The H2D
stream waits on an event the current stream recorded at `begin`: every reader queued
before the round began (the last forward and backward for the serial step; the last
step's publish and this forward for `step_in_backward`, which begins before backward;
the publish for `delay_param_update`'s step, which begins at step()).
Readers queued later, by a backward still running, need no wait: a chunk goes up only
once every group with a part in it was stepped, so each one's gradient was on the host,
and the CPU saw it there only after its D2H copy completed, which followed on the device
the group's backward and so every gather of its shard. Parts of no named range (frozen
groups, groups with no gradient) are rewritten with the bits they hold. Waiting instead
on the current stream as queued when a chunk completes held each copy behind every
backward kernel queued ahead of it, and a slot is reused only after its copy: under
`step_in_backward` the host step was paced by the GPU's backward.

On the CPU (gloo) there are no streams or events: the copies complete as they return.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch

from zeroshard.engine.runtime._offload_io import SideStream
from zeroshard.engine.runtime._offload_plan import UPLOAD_SLOTS

Alloc = Callable[[int, torch.dtype, bool], torch.Tensor]


class ShardUpload:
    """The compute shards of the chunk space `master` (chunks x shard elements, the first
    `used` of them masters), on the device behind pinned slots, or on the host (pinned)
    with offload_params."""

    def __init__(
        self,
        master: torch.Tensor,
        used: int,
        device: torch.device,
        compute_dtype: torch.dtype,
        *,
        pin: bool,
        offload_params: bool,
        alloc: Alloc,
    ) -> None:
        n, s = master.shape
        self.master, self.used, self.device, self.shard_numel = master, used, device, s
        self.compute_dtype = compute_dtype
        self._flat = master.view(-1)
        self.compute_host: torch.Tensor | None = None
        self.compute_dev: torch.Tensor | None = None
        if offload_params:
            self.compute_host = alloc(n * s, compute_dtype, pin).view(n, s)
        else:
            self.compute_dev = torch.zeros(n, s, dtype=compute_dtype, device=device)
        self._stream = SideStream(device)
        slots = 0 if offload_params else UPLOAD_SLOTS
        self._free = [alloc(s, compute_dtype, pin) for _ in range(slots)]
        self._busy: deque[tuple[torch.Tensor, torch.cuda.Event | None]] = deque()
        self._ready: list[torch.cuda.Event | None] = [None] * n
        # This round: elements of each chunk not yet final, the slot each open chunk
        # fills, chunks that gave theirs up, and the ranges no named range covers.
        self._waiting: dict[int, int] = {}
        self._open: dict[int, torch.Tensor] = {}
        self._spilled: set[int] = set()
        self._rest: dict[int, list[tuple[int, int]]] = {}
        self._begun: torch.cuda.Event | None = None

    def _pieces(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(chunk, start, end) of [lo, hi) cut at chunk boundaries, in order."""
        s = self.shard_numel
        pieces = [(i, max(lo, i * s), min(hi, (i + 1) * s)) for i in range(lo // s, -(-hi // s))]
        return [(i, a, b) for i, a, b in pieces if a < b]

    def begin(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Start a round: the masters of `ranges` (chunk space) will change; each chunk
        they touch goes up once all of its part in them was `written`."""
        self.finish()
        if self.device.type == "cuda":
            # [Note: upload stream order]
            self._begun = torch.cuda.current_stream(self.device).record_event()
        covered: dict[int, list[tuple[int, int]]] = {}
        for lo, hi in ranges:
            for i, a, b in self._pieces(lo, hi):
                self._waiting[i] = self._waiting.get(i, 0) + b - a
                covered.setdefault(i, []).append((a, b))
        s = self.shard_numel
        for i, parts in covered.items():
            at, rest = i * s, []
            for a, b in sorted(parts):
                if a > at:
                    rest.append((at, a))
                at = max(at, b)
            # Past `used` the chunk space is padding: zeros in the masters and the shards.
            end = min((i + 1) * s, self.used)
            if at < end:
                rest.append((at, end))
            self._rest[i] = rest
        if self._waiting and self.compute_host is not None and self.device.type == "cuda":
            # Gathers issued in the last step may still copy from the host shards; device
            # shards are ordered by the upload stream's wait instead.
            torch.cuda.current_stream(self.device).synchronize()

    def target(self, lo: int, hi: int) -> torch.Tensor | None:
        """Where the cast of the masters of [lo, hi) (within one chunk) goes: its part of
        the chunk's slot (taken now if the chunk has none) or of the host shards, for a
        step that writes the cast itself before `written(lo, hi, cast=False)`; None if the
        chunk gave its slot up (it is cast whole from the masters when complete)."""
        s = self.shard_numel
        i = lo // s
        assert hi <= (i + 1) * s, "a target lies within one chunk"
        if self.compute_host is not None:
            return self.compute_host.view(-1)[lo:hi]
        if i in self._spilled:
            return None
        slot = self._open.get(i)
        if slot is None:
            slot = self._open[i] = self._take_slot()
        return slot[lo - i * s : hi - i * s]

    def written(
        self, lo: int, hi: int, src: torch.Tensor | None = None, *, cast: bool = True
    ) -> None:
        """The masters of [lo, hi) (`src`, if given, is their view) are final for this
        round: cast them now (unless `cast` is False: the step wrote the cast into its
        `target`); send each chunk this completes."""
        s = self.shard_numel
        i = lo // s
        if not cast:
            assert hi <= (i + 1) * s, "a target lies within one chunk"
            self._count(i, hi - lo)
            return
        if hi <= (i + 1) * s:
            # Within one chunk, as nearly every block of the step is: no cutting.
            self._write(i, lo, hi, self._flat[lo:hi] if src is None else src)
            return
        for i, a, b in self._pieces(lo, hi):
            self._write(i, a, b, self._flat[a:b] if src is None else src[a - lo : b - lo])

    def _write(self, i: int, a: int, b: int, piece: torch.Tensor) -> None:
        """Cast `piece`, the masters of [a, b) in chunk `i`."""
        if self.compute_host is not None:
            self.compute_host.view(-1)[a:b].copy_(piece)
        elif i not in self._spilled:
            slot = self._open.get(i)
            if slot is None:
                slot = self._open[i] = self._take_slot()
            off = i * self.shard_numel
            slot[a - off : b - off].copy_(piece)
        self._count(i, b - a)

    def _count(self, i: int, numel: int) -> None:
        """`numel` more elements of chunk `i` are final: send it if that completes it."""
        left = self._waiting[i] - numel
        if left:
            self._waiting[i] = left
        else:
            del self._waiting[i]
            self._complete(i, whole=False)

    def finish(self) -> None:
        """Send the chunks of this round that are not complete, cast whole."""
        for i in sorted(self._waiting):
            self._complete(i, whole=True)
        self._waiting.clear()

    def _complete(self, i: int, *, whole: bool) -> None:
        rest = self._rest.pop(i, [])
        off = i * self.shard_numel
        flat = self._flat
        if self.compute_host is not None:
            for a, b in [(off, off + self.shard_numel)] if whole else rest:
                self.compute_host.view(-1)[a:b].copy_(flat[a:b])
            return
        slot = self._open.pop(i, None)
        if slot is None or whole:
            self._spilled.discard(i)
            slot = self._take_slot() if slot is None else slot
            rest = [(off, off + self.shard_numel)]
        for a, b in rest:
            slot[a - off : b - off].copy_(flat[a:b])
        assert self.compute_dev is not None
        # Only the masters go up: the padding's shard stays the zeros it was made as.
        n = min(self.shard_numel, self.used - off)
        with self._stream.after(self._begun):
            self.compute_dev[i, :n].copy_(slot[:n], non_blocking=True)
            self._ready[i] = self._stream.event()
        self._busy.append((slot, self._ready[i]))

    def _take_slot(self) -> torch.Tensor:
        if self._free:
            return self._free.pop()
        if self._busy:
            slot, event = self._busy.popleft()
            if event is not None:
                # The slot is rewritten next: its last copy must have read it.
                event.synchronize()
            return slot
        # Every slot is held by an incomplete chunk: the oldest gives its slot up.
        i = next(iter(self._open))
        self._spilled.add(i)
        return self._open.pop(i)

    def shard(self, lo: int, hi: int) -> torch.Tensor:
        """The compute shard of [lo, hi) on the device, ready for the current stream."""
        if self.compute_host is not None:
            host = self.compute_host.view(-1)[lo:hi]
            return host.to(self.device, non_blocking=host.is_pinned())
        if self.device.type == "cuda":
            current = torch.cuda.current_stream(self.device)
            for i, _, _ in self._pieces(lo, hi):
                event = self._ready[i]
                if event is not None:
                    current.wait_event(event)
        assert self.compute_dev is not None
        return self.compute_dev.view(-1)[lo:hi]
