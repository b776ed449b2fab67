"""Copying a step's tensors into a snapshot's host memory without stopping training.

[Note: the copy and the next step]
Host tensors are copied into the snapshot's shared memory at once, by the caller's
thread (an offloaded master may change as soon as the next step runs on the host).
Device tensors are copied straight into it (the slot is pinned: [Note: slots]) on a side
stream that first waits for the work that produced them; nothing in forward or backward
writes a master or an optimizer state, so the copy overlaps them, and the next optimizer
step waits for it on the device (`wait_before_step`, an optimizer pre-step hook), never
on the host. The background thread waits for the copy before it checksums the bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch


class HostCopy:
    """Copies tensors into their places in a snapshot (see [Note: the copy and the next step])."""

    def __init__(self) -> None:
        self._stream: torch.cuda.Stream | None = None
        self._copied: torch.cuda.Event | None = None

    def start(
        self, sources: Mapping[str, torch.Tensor], places: Mapping[str, torch.Tensor]
    ) -> Callable[[], None]:
        """Copy host sources into `places` now and device sources on a side stream;
        return what waits for the device's copies."""
        device = {k: t for k, t in sources.items() if t.device.type != "cpu"}
        for key, t in sources.items():
            if key not in device:
                places[key].copy_(t)
        if not device:
            return lambda: None
        if self._stream is None:
            self._stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for key, t in device.items():
                places[key].copy_(t, non_blocking=True)
                # A source the caller drops (a journal's gradient) is not reused before.
                t.record_stream(stream)
            copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            copied.record(stream)
        self._copied = copied
        return copied.synchronize

    def wait_before_step(self) -> None:
        """Make the current stream wait for the last copy (see [Note: the copy and the next
        step]); the host does not wait."""
        if self._copied is not None:
            torch.cuda.current_stream().wait_event(self._copied)
            self._copied = None
