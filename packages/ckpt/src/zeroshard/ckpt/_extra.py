"""`RankExtra`: a rank's own state beside its shards (the caller's, e.g. RNG states).

[Note: extra state in the rank file]
A rank may store a JSON text and a few tensors of its own with its shards. They go into
its own rank file, so they share the file's atomic commit and checksum: the tensors
under `extra.{name}` keys, the text in the safetensors header's `__metadata__` under
`zeroshard.extra`. No pickle is involved, and a reader that does not know about extras
(format version 2 readers) simply ignores both. Which rank saved an extra is the rank
file's number: meaning it at another world size is the caller's decision.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from zeroshard.ckpt._errors import CheckpointError
from zeroshard.ckpt._keys import EXTRA_METADATA, EXTRA_PREFIX, extra_key
from zeroshard.ckpt._reader import CheckpointReader


class RankExtra(NamedTuple):
    """One rank's extra state: a JSON `text` and tensors by name (see [Note: extra
    state in the rank file])."""

    text: str
    tensors: Mapping[str, torch.Tensor]


def extra_entries(extra: RankExtra, taken: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The extra's tensors under their file keys; CheckpointError if a key is taken."""
    out = {extra_key(name): t for name, t in extra.tensors.items()}
    clash = sorted(set(out) & set(taken))
    if clash:
        raise CheckpointError(f"extra tensors clash with shard or buffer keys: {clash[:5]}")
    return out


def read_extra(reader: CheckpointReader, rank: int) -> RankExtra | None:
    """Rank file `rank`'s extra state, or None if it saved none."""
    header = reader.header(rank)
    text = header.metadata.get(EXTRA_METADATA)
    if text is None:
        return None
    tensors = {}
    for key, entry in header.entries.items():
        if key.startswith(EXTRA_PREFIX):
            out = torch.empty(entry.shape, dtype=entry.dtype)
            reader.read_entry(rank, key, 0, out.view(-1))
            tensors[key[len(EXTRA_PREFIX) :]] = out
    return RankExtra(text, tensors)
