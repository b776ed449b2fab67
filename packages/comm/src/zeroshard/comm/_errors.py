"""Errors raised by collectives."""

from __future__ import annotations

import datetime


class CollectiveTimeoutError(RuntimeError):
    """A collective did not finish in time: usually a rank skipped it or diverged."""

    def __init__(
        self, op: str, label: str, timeout: datetime.timedelta, cause: BaseException
    ) -> None:
        where = f" for {label!r}" if label else ""
        super().__init__(
            f"{op}{where} did not finish within {timeout.total_seconds():g}s "
            f"(did a rank skip or reorder this collective?): {cause}"
        )
        self.op = op
        self.label = label
        self.timeout = timeout
