"""Errors raised by collectives."""

from __future__ import annotations

import datetime

# A wait that ends this close to its timeout counts as "ran out of time"; one that ends
# sooner failed for another reason (a peer closed its connection, a communicator abort).
_TIMED_OUT_FRACTION = 0.9


class CollectiveTimeoutError(RuntimeError):
    """A collective failed or did not finish in time: a rank skipped, reordered or left it.

    `op` is the collective ("all_gather", ...), `label` the caller's name for it (a
    module, a bucket), `elapsed` the seconds `wait()` spent before the failure and
    `timed_out` whether that reached the timeout (False: a peer failed or exited first).
    """

    def __init__(
        self,
        op: str,
        label: str,
        timeout: datetime.timedelta,
        cause: BaseException,
        elapsed: float | None = None,
    ) -> None:
        limit = timeout.total_seconds()
        timed_out = elapsed is None or elapsed >= _TIMED_OUT_FRACTION * limit
        where = f" for {label!r}" if label else ""
        if timed_out:
            what = f"did not finish within {limit:g}s (did a rank skip or reorder it?)"
        else:
            what = (
                f"failed after {elapsed:.1f}s of a {limit:g}s timeout "
                "(did a peer exit, crash or leave the group?)"
            )
        super().__init__(f"collective {op}{where} failed or did not finish: {what}; cause: {cause}")
        self.op = op
        self.label = label
        self.timeout = timeout
        self.elapsed = elapsed
        self.timed_out = timed_out
        self.cause = cause
