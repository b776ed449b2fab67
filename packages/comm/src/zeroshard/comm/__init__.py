"""zeroshard.comm: collectives on flat buffers over gloo (CPU) and NCCL (CUDA).

`Group` wraps a process group; every collective returns a `Handle` whose `wait()`
finishes it or raises `CollectiveTimeoutError` naming the operation and a label.
`make_hybrid_groups` builds shard and replicate subgroups.
"""

from zeroshard.comm._errors import CollectiveTimeoutError
from zeroshard.comm._group import DEFAULT_TIMEOUT, Group, Handle, ReduceOp, completed_handle
from zeroshard.comm._hybrid import HybridGroups, make_hybrid_groups

__all__ = [
    "DEFAULT_TIMEOUT",
    "CollectiveTimeoutError",
    "Group",
    "Handle",
    "HybridGroups",
    "ReduceOp",
    "completed_handle",
    "make_hybrid_groups",
]
