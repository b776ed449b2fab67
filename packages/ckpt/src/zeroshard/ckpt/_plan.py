"""Plan a streamed safetensors output: which tensor goes to which file at which offset.

Everything here comes from the specs alone (names, shapes, dtypes), before any data is
read, so each file's header can be written first and its tensors filled in any order.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as dc_field

import torch

from zeroshard.ckpt._errors import CheckpointError
from zeroshard.ckpt._spec import TensorSpec
from zeroshard.ckpt._stfile import Header, plan_header

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str | int) -> int:
    """Bytes in a size like '5GB' (10^9, as Hugging Face counts), '512MiB' or '1000'."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"bad size {text!r}: use e.g. 5GB, 500MB, 2GiB or a byte count")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


def output_dtype(spec: TensorSpec, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor is written in: `dtype` for floating tensors, else unchanged."""
    if dtype is not None and spec.dtype.is_floating_point:
        return dtype
    return spec.dtype


@dataclass(frozen=True)
class PlannedFile:
    """One output file: its name, header bytes, and where each tensor's data goes."""

    name: str
    head: bytes
    header: Header
    specs: tuple[TensorSpec, ...] = dc_field(default=())


@dataclass(frozen=True)
class OutputPlan:
    """All output files, and the index that maps tensors to files (None for one file)."""

    files: tuple[PlannedFile, ...]
    index: dict[str, object] | None
    total_bytes: int


def plan_output(
    specs: Sequence[TensorSpec],
    *,
    dtype: torch.dtype | None,
    max_shard_size: int | None,
    metadata: Mapping[str, str],
    single_name: str = SINGLE_FILE,
) -> OutputPlan:
    """Split specs into files of at most `max_shard_size` bytes (a bigger tensor alone)."""
    names = [s.name for s in specs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise CheckpointError(f"tensor names appear twice in the output: {dupes[:10]}")
    groups: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        nbytes = s.numel * output_dtype(s, dtype).itemsize
        if groups[-1] and max_shard_size is not None and size + nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(s)
        size += nbytes
    n = len(groups)
    files: list[PlannedFile] = []
    for i, group in enumerate(groups):
        name = single_name if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        # Widest dtypes first: every tensor then starts at a multiple of its item size
        # (the header is padded to 8 bytes), which zero-copy loaders rely on.
        ordered = sorted(group, key=lambda s: -output_dtype(s, dtype).itemsize)
        head, header = plan_header(
            ((s.name, output_dtype(s, dtype), tuple(s.shape)) for s in ordered), metadata
        )
        files.append(PlannedFile(name, head, header, tuple(ordered)))
    total = sum(f.header.size - f.header.data_start for f in files)
    index = None
    if n > 1:
        weight_map = {s.name: f.name for f in files for s in f.specs}
        index = {
            "metadata": {"total_size": total},
            "weight_map": dict(sorted(weight_map.items())),
        }
    return OutputPlan(tuple(files), index, total)


def index_text(index: Mapping[str, object]) -> str:
    """The index file's text (Hugging Face's layout)."""
    return json.dumps(index, indent=2) + "\n"
