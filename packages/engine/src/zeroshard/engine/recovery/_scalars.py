"""A snapshot's scalars held as tensors, written into its header without a sync.

[Note: scalars without a sync]
A snapshot's header holds a few numbers that live in one-element tensors: fused or
capturable AdamW's `step` (on the device), a learning rate given as a tensor (the
metadata's param groups, a journal entry's hyperparameters). A checkpoint writes their
`.item()`, which on CUDA waits for the device to finish everything queued: at `take`
the host would lose its whole lead over the device (~150 ms a full snapshot of a 1.3B
model, measured). `take` never asks for their values. Each becomes a placeholder in the
metadata (`Scalars.defer`: a string whose JSON is longer than any `.item()`'s can be,
so the header planned with it has room for the value); their values as of `take` are
taken on the training stream (one `torch.stack` per dtype: later in-place writes, the
next step's, do not reach it) and copied to pinned host memory on the snapshot's side
stream, ahead of its tensors' copies (`HostCopy.fetch`). The stack, not the live tensors
read by the side stream: a scheduler writes a tensor learning rate in place outside the
optimizer step, and no step waits for an entry's copy. The background thread waits for
that copy, writes the header again with the values (`Scalars.resolve`: the values
`.item()` would give, ints as ints, floats as floats), padded with spaces to the planned
length, so offsets and the file's size stay as planned, and only then seals the bytes
(the checksum reads the header first). Rendered again, not patched where the
placeholders were: the metadata's text carries its own crc32 ([Note: the metadata's own
checksum] in zeroshard.ckpt), which `to_json` computes over the values. The file is the
one a `.item()` would have written, but for spaces in its JSON, so a restore reads it as
it reads any. The journal keeps the hyperparameters a step consumed the same way (a
tensor's copy at `step()`, its value read by the entry's `take`). On the CPU the same
path runs (the values are taken at `take`, the header written in the background), so
tests exercise it. `checkpoint_contents`' object gathers (`rank_sets`: groups of their
own; `param_states`: a whole-matrix optimizer's), which over NCCL `all_gather_object`
stages through the device, go over a gloo twin of the file group at `take`
(`object_group` in _contents.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from zeroshard.ckpt import CheckpointMeta


class _Placeholder(str):
    """A deferred scalar's place in the metadata: a JSON string of `_WIDTH` characters,
    two more with its quotes than the longest JSON a float's `.item()` gives (24:
    "-2.2250738585072014e-308"; an int64's is 20, a bool's 5)."""

    number: int


_WIDTH = 24
_DEFERRED = {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.bool}
_DEFERRED |= {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8}


def _placeholder(number: int) -> _Placeholder:
    out = _Placeholder(f"zeroshard-scalar-{number:0{_WIDTH - 17}d}")
    out.number = number
    return out


class Scalars:
    """The scalars of one snapshot deferred so far (see [Note: scalars without a sync])."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []

    def defer(self, t: torch.Tensor) -> Any:
        """A placeholder for `t.item()` (`checkpoint_contents`'s `scalar`); the value of
        a dtype whose JSON is not a number or a bool (complex) at once."""
        if t.numel() != 1 or t.dtype not in _DEFERRED:
            return t.item()
        self.tensors.append(t.detach().reshape(()))
        return _placeholder(len(self.tensors) - 1)

    def resolve(self, value: Any, values: Sequence[Any]) -> Any:
        """`value` (metadata, a journal record, a JSON value) with each placeholder
        replaced by its scalar's value in `values` (`HostCopy.fetch`'s)."""
        if isinstance(value, _Placeholder):
            return values[value.number]
        if isinstance(value, CheckpointMeta):
            groups = tuple(
                replace(g, scalars=self.resolve(g.scalars, values)) for g in value.groups
            )
            params = tuple(self.resolve(p, values) for p in value.param_groups)
            return replace(value, groups=groups, param_groups=params)
        if isinstance(value, Mapping):
            return {k: self.resolve(v, values) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.resolve(v, values) for v in value]
        return value
