"""`phase`: a profiler label on a phase of the step, free when no profiler runs.

`record_function` enters and leaves a dispatcher op even when nothing records it
(docs/benchmarks.md, design-measurements): on the per-unit and per-bucket paths, a
hundred or more a step, that is host time the GPU may wait for. The labels exist for the
profiler's trace (benchmarks/train_step reads `zeroshard::optimizer_step`), so they are
made only while a profiler runs.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

from torch._C._autograd import _profiler_enabled
from torch.autograd.profiler import record_function

_NONE = contextlib.nullcontext()


def phase(name: str) -> AbstractContextManager[object]:
    """`record_function(name)` while a profiler runs; otherwise a context that does nothing."""
    if _profiler_enabled():
        return record_function(name)
    return _NONE
