"""Copying a step's tensors into a snapshot's host memory without stopping training.

[Note: the copy and the next step]
Host tensors are copied into the snapshot's shared memory at once, by the caller's
thread (an offloaded master may change as soon as the next step runs on the host).
Device tensors are copied straight into it (the slot is pinned: [Note: slots]) on a side
stream that first waits for the work that produced them; nothing in forward or backward
writes a master or an optimizer state, so the copy overlaps them, and the next optimizer
step waits for it on the device (`wait_before_step`, an optimizer pre-step hook), never
on the host. A journal entry's copy is not waited for (`before_step=False`): it reads
gradient shards only the journal still references (their memory is not reused before
the copy: `record_stream`) and clones, which no step writes, so a full snapshot's long
copy ahead of it on the side stream does not stall the steps after the next. The
background thread checksums the bytes as they arrive: each piece once the copies into
it are done (an event after each tensor's copy), so the checksum overlaps the copy
instead of following it. The snapshot's scalars held as tensors go first
(`fetch`: [Note: scalars without a sync] in _scalars.py): the header they complete is
the first piece the checksum reads.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

# Wait until the copies into host memory below an address are done (None: all of them).
Ready = Callable[[int | None], None]


def _copied(upto: int | None = None) -> None:
    """Nothing to wait for: the host copied it all."""


class HostCopy:
    """Copies tensors into their places in a snapshot (see [Note: the copy and the next step])."""

    def __init__(self) -> None:
        self._stream: torch.cuda.Stream | None = None
        self._copied: torch.cuda.Event | None = None

    def _side(self) -> torch.cuda.Stream:
        """The side stream, once it waits for the work queued on the current one."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        self._stream.wait_stream(torch.cuda.current_stream())
        return self._stream

    def fetch(self, scalars: Sequence[torch.Tensor]) -> Callable[[], list[Any]]:
        """The values `.item()` gives of the one-element `scalars` as they are now, with
        no wait for the device: taken now (a copy per device and dtype; later writes do
        not reach it), those on the device copied to pinned host memory on the side
        stream, ahead of the copies `start` issues next. The function returned waits for
        that copy ([Note: scalars without a sync] in _scalars.py)."""
        kinds: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, t in enumerate(scalars):
            kinds.setdefault((t.device, t.dtype), []).append(i)
        taken: list[tuple[list[int], torch.Tensor]] = []
        copied: torch.cuda.Event | None = None
        for (device, dtype), where in kinds.items():
            now = torch.stack([scalars[i].reshape(()) for i in where])
            if device.type != "cpu":
                stream = self._side()
                with torch.cuda.stream(stream):
                    host = torch.empty(now.shape, dtype=dtype, pin_memory=True)
                    host.copy_(now, non_blocking=True)
                    now.record_stream(stream)
                    copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    copied.record(stream)
                now = host
            taken.append((where, now))

        def values() -> list[Any]:
            if copied is not None:
                copied.synchronize()  # the last of the copies (the stream runs in order)
            out: list[Any] = [None] * len(scalars)
            for where, host in taken:
                for i, v in zip(where, host.tolist(), strict=True):
                    out[i] = v
            return out

        return values

    def start(
        self,
        sources: Mapping[str, torch.Tensor],
        places: Mapping[str, torch.Tensor],
        *,
        before_step: bool = True,
    ) -> Ready:
        """Copy host sources into `places` now and device sources on a side stream;
        return what waits for the device's copies (those below an address, or all).
        `before_step`: the next optimizer step writes the sources, so it waits for them."""
        device = {k: t for k, t in sources.items() if t.device.type != "cpu"}
        for key, t in sources.items():
            if key not in device:
                places[key].copy_(t)
        if not device:
            return _copied
        stream = self._side()
        starts: list[int] = []
        events: list[torch.cuda.Event] = []
        with torch.cuda.stream(stream):
            # In the order of their places, so an event says every copy below it is done.
            for key, t in sorted(device.items(), key=lambda kv: places[kv[0]].data_ptr()):
                places[key].copy_(t, non_blocking=True)
                # A source the caller drops (a journal's gradient) is not reused before.
                t.record_stream(stream)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
                starts.append(places[key].data_ptr())
                events.append(event)
        if before_step:
            self._copied = events[-1]

        def ready(upto: int | None = None) -> None:
            # The last copy starting below `upto` (the stream runs them in order).
            k = len(events) if upto is None else bisect.bisect_left(starts, upto)
            if k:
                events[k - 1].synchronize()

        return ready

    def wait_before_step(self) -> None:
        """Make the current stream wait for the last copy (see [Note: the copy and the next
        step]); the host does not wait."""
        if self._copied is not None:
            torch.cuda.current_stream().wait_event(self._copied)
            self._copied = None
