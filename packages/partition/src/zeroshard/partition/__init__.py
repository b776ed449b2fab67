"""zeroshard.partition: flat layouts, even sharding, chunks, and tiered flattening.

`FlatLayout` says which parameter lives at which offset of a flat buffer and which
part of it each rank's shard holds; checkpoints store it as JSON. `group_parameters`
decides which parameters share a buffer, `flatten_params` packs them (on the device,
distributed over ranks, or via the CPU), and `ChunkLayout` cuts a
buffer into evenly sharded fixed-size chunks; `empty_host` allocates host buffers,
pinned when the platform allows it.
"""

from zeroshard.partition._chunks import CHUNK_FORMAT_VERSION, ChunkLayout
from zeroshard.partition._flatten import FlattenTier, flatten_params, flatten_shard, unflatten
from zeroshard.partition._groups import DEFAULT_GROUP_LABEL, GroupKey, group_parameters
from zeroshard.partition._host import empty_host
from zeroshard.partition._layout import (
    FORMAT_VERSION,
    FlatLayout,
    Piece,
    Slot,
    dtype_from_name,
    dtype_name,
)

__all__ = [
    "CHUNK_FORMAT_VERSION",
    "DEFAULT_GROUP_LABEL",
    "FORMAT_VERSION",
    "ChunkLayout",
    "FlatLayout",
    "FlattenTier",
    "GroupKey",
    "Piece",
    "Slot",
    "dtype_from_name",
    "dtype_name",
    "empty_host",
    "flatten_params",
    "flatten_shard",
    "group_parameters",
    "unflatten",
]
