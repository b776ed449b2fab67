"""zeroshard.partition: flat layouts, even sharding, chunks, and tiered flattening.

`FlatLayout` says which parameter lives at which offset of a flat buffer and which
part of it each rank's shard holds; checkpoints store it as JSON.
"""

from zeroshard.partition._layout import (
    FORMAT_VERSION,
    FlatLayout,
    Piece,
    Slot,
    dtype_from_name,
    dtype_name,
)

__all__ = [
    "FORMAT_VERSION",
    "FlatLayout",
    "Piece",
    "Slot",
    "dtype_from_name",
    "dtype_name",
]
