"""The compute-dtype shards of offloaded groups, rewritten from their masters.

[Note: offload upload]
After a step (or any change of the masters) the compute shards are rewritten chunk by
chunk ([Note: offload stream order] in _host_offload.py). `begin` names the chunk-space
ranges that will change; `written(lo, hi)` says that the masters of [lo, hi) are final.
Once all of a chunk's part in those ranges is final, the chunk goes up: its masters
(pinned) are copied by the H2D stream into an fp32 staging chunk on the device and cast
there into the device shards. The CPU writes no cast at all: the step's loop reads the
gradient and the master and moments and writes those back, nothing more ([Note: compiled
host step] in _compiled_step.py). A cast on the host, into pinned compute-dtype buffers
sent up after it, would cost the host 4 bytes of memory traffic a parameter (the write,
and the read of its lines first) where the fp32 copy costs the bus 2 more, and host
memory is what bounds the step (docs/benchmarks.md, sections
offload-deepspeed-fp32-upload and design-measurements). The bits are the same: a cast of
the same fp32 value, round to nearest even on either side. With compute in fp32
the masters go straight into the device shards.

The masters of a chunk are rewritten by the next round's step only: `begin` waits for
every copy of the round before (the last one queued: they share the H2D stream), so a
step never writes masters a copy still reads. The
one staging chunk is reused in stream order (each copy and its cast queue on the H2D
stream, the next copy after the cast before it).

With offload_params the compute shards stay on the host (pinned): `target` gives the step
their part of a chunk to write its cast into while the masters are in cache, and
`written` casts what no step wrote. A chunk's parts that no named range covers (frozen
groups, padding) are rewritten when it completes. Where the masters are in the compute
dtype (bf16 masters) they are the compute shards: one pinned array, nothing to cast or
copy, the gathers upload from the masters themselves (2 host bytes a parameter fewer).

[Note: masters read by gathers]
Then what a gather reads, the step writes, so a write must not start while a gather's
copy from the masters is still queued. The step's are ordered as the host shards' writes
always were: `begin` synchronizes the current stream first (the last forward's and
backward's gathers), and under `step_in_backward` a group is stepped only once its
gradient landed, whose copy followed on the device every gather of its shard in that
backward ([Note: upload stream order]). Anything else that writes masters (a load, an
edit in `gathered_parameters`, a whole-matrix optimizer's step) calls
`ZeroOptimizer.settle` first, which waits for the last gather's copy (`settle_reads`).

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
on the current stream as queued when a chunk completes would hold each copy behind every
backward kernel queued ahead of it, and a host buffer reused only after its copy would
then pace the host step under `step_in_backward` by the GPU's backward.

On the CPU (gloo) there are no streams or events: the copies complete as they return.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from zeroshard.engine.runtime.offload._io import SideStream

Alloc = Callable[[int, torch.dtype, bool], torch.Tensor]


class ShardUpload:
    """The compute shards of the chunk space `master` (chunks x shard elements, the first
    `used` of them masters; pinned where they go up), on the device, or on the host
    (pinned) with offload_params."""

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
        # The staging chunk on the device that a chunk's masters are cast from (none where
        # they are in the compute dtype: they go straight into the shards).
        self._stage: torch.Tensor | None = None
        if offload_params and compute_dtype == master.dtype:
            # [Note: masters read by gathers]
            self.compute_host = master
        elif offload_params:
            self.compute_host = alloc(n * s, compute_dtype, pin).view(n, s)
        else:
            self.compute_dev = torch.zeros(n, s, dtype=compute_dtype, device=device)
            if compute_dtype != master.dtype:
                self._stage = torch.empty(s, dtype=master.dtype, device=device)
        self._stream = SideStream(device)
        if self._stream.stream is not None:
            # Allocated on the current stream, written on the upload stream as long as they
            # live: when freed (the engine dropped), their memory waits for that stream's
            # last copy before the allocator hands it out again.
            for t in (self.compute_dev, self._stage):
                if t is not None:
                    t.record_stream(self._stream.stream)
        self._ready: list[torch.cuda.Event | None] = [None] * n
        # The event of the copy queued last: every copy before it is on the same stream.
        self._last_copy: torch.cuda.Event | None = None
        # This round: elements of each chunk not yet final, and the ranges no named range
        # covers.
        self._waiting: dict[int, int] = {}
        self._rest: dict[int, list[tuple[int, int]]] = {}
        self._begun: torch.cuda.Event | None = None
        # With the masters as the compute shards: each stream's event after the last
        # gather's copy from them on it ([Note: masters read by gathers]).
        self._reads: dict[int, torch.cuda.Event] = {}

    @property
    def masters_are_shards(self) -> bool:
        """Whether the compute shards are the masters themselves (offload_params with
        masters in the compute dtype)."""
        return self.compute_host is self.master

    def settle_reads(self) -> None:
        """Wait until no gather's copy from the masters is queued, so that they may be
        written ([Note: masters read by gathers])."""
        for event in self._reads.values():
            event.synchronize()
        self._reads.clear()

    @property
    def device_nbytes(self) -> int:
        """Bytes on the device: the compute shards and the staging chunk (none with
        offload_params)."""
        held = [t for t in (self.compute_dev, self._stage) if t is not None]
        return sum(t.nbytes for t in held)

    def _pieces(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(chunk, start, end) of [lo, hi) cut at chunk boundaries, in order."""
        s = self.shard_numel
        pieces = [(i, max(lo, i * s), min(hi, (i + 1) * s)) for i in range(lo // s, -(-hi // s))]
        return [(i, a, b) for i, a, b in pieces if a < b]

    def begin(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Start a round: the masters of `ranges` (chunk space) will change; each chunk
        they touch goes up once all of its part in them was `written`."""
        self.finish()
        if self._last_copy is not None:
            # The step about to run rewrites masters the last round's copies read.
            self._last_copy.synchronize()
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
            self.settle_reads()

    def target(self, lo: int, hi: int) -> torch.Tensor | None:
        """Where a step writes the cast of the masters of [lo, hi) (within one chunk) before
        `written(lo, hi, cast=False)`: the host shards' part with offload_params; None
        where the masters go up in fp32 and the device casts them, and where the masters
        are the host shards themselves (the step's write of the masters is the cast)."""
        s = self.shard_numel
        assert hi <= (lo // s + 1) * s, "a target lies within one chunk"
        if self.compute_host is None or self.masters_are_shards:
            return None
        return self.compute_host.view(-1)[lo:hi]

    def written(
        self, lo: int, hi: int, src: torch.Tensor | None = None, *, cast: bool = True
    ) -> None:
        """The masters of [lo, hi) (`src`, if given, is their view) are final for this
        round: with offload_params cast them into the host shards now, unless `cast` is
        False (the step wrote its `target`); send each chunk this completes."""
        if cast and self.compute_host is not None and not self.masters_are_shards:
            self.compute_host.view(-1)[lo:hi].copy_(self._flat[lo:hi] if src is None else src)
        for i, a, b in self._pieces(lo, hi):
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
        if self.masters_are_shards:
            return
        if self.compute_host is not None:
            for a, b in [(off, off + self.shard_numel)] if whole else rest:
                self.compute_host.view(-1)[a:b].copy_(flat[a:b])
            return
        assert self.compute_dev is not None
        # Only the masters go up: the padding's shard stays the zeros it was made as.
        n = min(self.shard_numel, self.used - off)
        with self._stream.after(self._begun):
            masters = flat[off : off + n]
            if self._stage is None:
                self.compute_dev[i, :n].copy_(masters, non_blocking=True)
            else:
                # torch would cast a host-to-device copy on the host: copy, then cast.
                self._stage[:n].copy_(masters, non_blocking=True)
                self.compute_dev[i, :n].copy_(self._stage[:n])
            self._ready[i] = self._last_copy = self._stream.event()

    def shard(self, lo: int, hi: int) -> torch.Tensor:
        """The compute shard of [lo, hi) on the device, ready for the current stream."""
        if self.compute_host is not None:
            host = self.compute_host.view(-1)[lo:hi]
            up = host.to(self.device, non_blocking=host.is_pinned())
            if self.masters_are_shards and self.device.type == "cuda":
                stream = torch.cuda.current_stream(self.device)
                self._reads[stream.cuda_stream] = stream.record_event()
            return up
        if self.device.type == "cuda":
            current = torch.cuda.current_stream(self.device)
            for i, _, _ in self._pieces(lo, hi):
                event = self._ready[i]
                if event is not None:
                    current.wait_event(event)
        assert self.compute_dev is not None
        return self.compute_dev.view(-1)[lo:hi]
