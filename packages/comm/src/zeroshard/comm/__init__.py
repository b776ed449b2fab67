"""zeroshard.comm: collectives on flat buffers over gloo (CPU) and NCCL (CUDA).

`Group` wraps a process group; every collective returns a `Handle` whose `wait()`
finishes it or raises `CollectiveTimeoutError` naming the operation and a label.
`make_hybrid_groups` builds shard and replicate subgroups. `init_process_group` sets up
the default group from the launcher's environment, safely across torchrun restarts.
`warn_on_rank0` / `warn_tagged` warn once per job (or per rank, naming it) at the
user's line. `Agreement` (and `agreed`) brings every rank to one outcome: the same
error on every rank when one failed, or when a value differs between ranks. `arrive`
fails a call made on some ranks only within seconds, not the collective timeout.
"""

from zeroshard.comm._agree import Agreement, agreed
from zeroshard.comm._arrive import ARRIVAL_WINDOW, arrive
from zeroshard.comm._errors import CollectiveTimeoutError
from zeroshard.comm._group import DEFAULT_TIMEOUT, Group, Handle, ReduceOp, completed_handle
from zeroshard.comm._hybrid import HybridGroups, make_hybrid_groups
from zeroshard.comm._init import init_process_group
from zeroshard.comm._warn import is_rank0, process_rank, warn_on_rank0, warn_tagged

__all__ = [
    "ARRIVAL_WINDOW",
    "DEFAULT_TIMEOUT",
    "Agreement",
    "CollectiveTimeoutError",
    "Group",
    "Handle",
    "HybridGroups",
    "ReduceOp",
    "agreed",
    "arrive",
    "completed_handle",
    "init_process_group",
    "is_rank0",
    "make_hybrid_groups",
    "process_rank",
    "warn_on_rank0",
    "warn_tagged",
]
