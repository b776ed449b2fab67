"""The snapshots' background work: one thread per snapshot, chained in step order.

[Note: snapshots in the background]
Each snapshot's thread first seals its own bytes (the checksum, as the copy arrives) and
links them in place, which touches nothing another snapshot uses, so it overlaps the
snapshots before it; then it waits for the thread before it and replicates, so the
snapshots' process group sees every rank's messages in the same (step) order. `take`
does not wait for the snapshot before it: only for the slot it writes into to be free,
which is when the full snapshot that made the slot's old step unneeded is complete
(`wait_complete`). A thread's error stops the ones after it (their replication would
not match the peers') and is raised by the next `take` or `wait`; the snapshots are
then broken: every later `take` raises too (a `resume` starts them again).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


class Background:
    """The chain of snapshot threads, and the newest full snapshot complete on every rank."""

    def __init__(self) -> None:
        self._tail: threading.Thread | None = None
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._broken = False  # a thread failed: the ones after it do not replicate
        self.complete: int | None = None  # the newest full snapshot complete everywhere

    def start(
        self, step: int, own: Callable[[], torch.Tensor], then: Callable[[torch.Tensor], None]
    ) -> None:
        """Run `own()` at once, then `then(its result)` after the snapshots before."""
        before = self._tail

        def work() -> None:
            try:
                done = own()
                if before is not None:
                    before.join()
                if not self._broken:
                    then(done)
            except BaseException as e:  # raised on the main thread by `raise_error`
                with self._cond:
                    self._error = self._error or e
                    self._broken = True
                    self._cond.notify_all()

        self._tail = threading.Thread(target=work, name=f"zeroshard-snapshot-{step}")
        self._tail.daemon = True
        self._tail.start()

    def completed(self, step: int) -> None:
        """Full snapshot `step` is complete on every rank."""
        with self._cond:
            self.complete = step
            self._cond.notify_all()

    def wait_complete(self, step: int) -> None:
        """Wait until full snapshot `step` (or a newer one) is complete; raise an error."""
        with self._cond:
            self._cond.wait_for(lambda: self._broken or (self.complete or -1) >= step)
        self.raise_error()

    def wait(self) -> None:
        """Wait for every snapshot in flight; raise an error."""
        if self._tail is not None:
            self._tail.join()
            self._tail = None
        self.raise_error(broken=False)

    def raise_error(self, *, broken: bool = True) -> None:
        """Raise the error a snapshot's thread met (once), and with `broken`, that one did
        before (a new snapshot would never complete)."""
        with self._cond:
            error, self._error = self._error, None
            broken = broken and self._broken
        if error is not None:
            raise RuntimeError(f"snapshots: the last snapshot failed: {error}") from error
        if broken:
            raise RuntimeError("snapshots: a snapshot failed before: resume() to go on")

    def reset(self) -> None:
        """After `wait`: no snapshot in flight, none complete, not broken (a resume)."""
        with self._cond:
            self._error, self._broken, self.complete = None, False, None
