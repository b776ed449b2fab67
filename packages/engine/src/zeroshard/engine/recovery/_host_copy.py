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
instead of following it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping

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
        if self._stream is None:
            self._stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())
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
