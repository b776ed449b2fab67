"""What every benchmark shares: the report writer, the start of ranks, matplotlib, the
benchmarked models and their optimizer, device waits and emptying.

No benchmark imports another; what two of them need lives here.
"""

from benchmarks._common._device import free, sync
from benchmarks._common._models import LR, MODELS, BenchModel, adamw, bench_model
from benchmarks._common._plot import pyplot
from benchmarks._common._ranks import (
    Placement,
    init_ranks,
    join,
    place_ranks,
    place_torchrun_ranks,
    spawn_ranks,
)
from benchmarks._common._report import (
    DOC,
    RESULTS,
    ROOT,
    SMOKE_OUT,
    code_version,
    command,
    entry_point,
    environment,
    markdown_table,
    publish,
    replace_section,
    write_section,
)

__all__ = [
    "DOC",
    "LR",
    "MODELS",
    "BenchModel",
    "Placement",
    "RESULTS",
    "ROOT",
    "SMOKE_OUT",
    "adamw",
    "bench_model",
    "code_version",
    "command",
    "entry_point",
    "environment",
    "free",
    "init_ranks",
    "join",
    "markdown_table",
    "place_ranks",
    "place_torchrun_ranks",
    "publish",
    "pyplot",
    "replace_section",
    "spawn_ranks",
    "sync",
    "write_section",
]
