"""`logged(name)`: the messages a logger logs inside a block, INFO and up."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


class _Lines(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.INFO)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def logged(name: str = "zeroshard.engine") -> Iterator[list[str]]:
    """Collect the messages of logger `name` (and its children) logged inside the block."""
    lines: list[str] = []
    handler, log = _Lines(lines), logging.getLogger(name)
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        yield lines
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
