"""The writer's host buffers: a pool shared by all workers, bounded in bytes, not in count.

[Note: bytes in flight]
Every byte a consolidation holds in host memory for tensor data is a buffer taken from
one `BufferPool`: the source bytes read from the checkpoint and, when casting, the cast
result (one buffer per task holds both, so a task never waits for its second half while
holding its first: no deadlock between workers). The pool counts the bytes of every
buffer that exists, in use or idle, and `take` blocks while a new buffer would push
that count over `limit`, so the bound holds for any number of workers: 64 threads on
a 1 GiB pool share 1 GiB. Idle buffers are kept for reuse because a fresh buffer of
tens of MiB is page-faulted and zeroed by the kernel on first touch, a cost comparable
to the copy itself; they are freed when a bigger request needs the room. A buffer is
freed by resizing its storage to 0 bytes, under the pool's lock, before its bytes are
uncounted: a caller's lingering reference cannot keep memory the pool no longer counts.
One request
larger than `limit` (a whole tensor whose source cannot be read in parts) is let
through only when no other buffer exists, so it is alone in flight.
"""

from __future__ import annotations

import threading

import torch

# Buffers below this size are not kept idle (malloc serves them from its free lists).
SMALL_BYTES = 1 << 20


class BufferPool:
    """Byte buffers (uint8 tensors) for the writer's tasks, at most `limit` bytes at once.

    `keep` is the largest buffer kept idle for reuse after `give` (the chunk size);
    bigger ones are freed at once. `peak` is the most bytes that existed at one time.
    """

    def __init__(self, limit: int, keep: int) -> None:
        if limit < 1:
            raise ValueError(f"the buffer memory bound must be >= 1 byte, got {limit}")
        self.limit = limit
        self.keep = keep
        self.peak = 0
        self._held = 0  # bytes of all buffers that exist: taken or idle
        self._idle: list[torch.Tensor] = []
        self._cond = threading.Condition()

    @property
    def held(self) -> int:
        """Bytes of all buffers that exist now, taken or idle."""
        with self._cond:
            return self._held

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least `nbytes` bytes; blocks until the bound leaves room for it."""
        with self._cond:
            while True:
                reused = self._reuse(nbytes)
                if reused is not None:
                    return reused
                # Free idle buffers (biggest first) until the new one fits.
                self._idle.sort(key=lambda b: b.numel())
                while self._idle and self._held + nbytes > self.limit:
                    self._free(self._idle.pop())
                if self._held + nbytes <= self.limit or self._held == 0:
                    self._held += nbytes
                    self.peak = max(self.peak, self._held)
                    break
                self._cond.wait()
        # Allocated outside the lock: it is already counted, and others may go on.
        return torch.empty(nbytes, dtype=torch.uint8)

    def _free(self, buf: torch.Tensor) -> None:
        # The memory goes now, whoever still holds the tensor (it must not be used again).
        buf.untyped_storage().resize_(0)
        self._held -= buf.numel()

    def _reuse(self, nbytes: int) -> torch.Tensor | None:
        # The smallest idle buffer that fits. Tasks come biggest first, so after the first
        # round every request fits an idle buffer: the pool settles at about workers x
        # the biggest task, and allocates nothing more.
        fits = [i for i, b in enumerate(self._idle) if b.numel() >= nbytes]
        if not fits:
            return None
        best = min(fits, key=lambda i: self._idle[i].numel())
        return self._idle.pop(best)

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer from `take`: kept for reuse, or freed (small or oversized ones)."""
        with self._cond:
            if SMALL_BYTES <= buf.numel() <= self.keep:
                self._idle.append(buf)
            else:
                self._free(buf)
            self._cond.notify_all()

    def clear(self) -> None:
        """Free the idle buffers (the taken ones are freed as they come back)."""
        with self._cond:
            while self._idle:
                self._free(self._idle.pop())
            self._cond.notify_all()
