"""`CheckpointMeta`: everything `metadata.json` says, as a frozen dataclass (its parts in
`_group_meta.py`, the rank files' key names in `_keys.py`), and the format's versions.

A checkpoint's rank files hold flat shards under keys `"{group}.{kind}"` (`kind` is
`master`, `param` or `optim.{state}`) and, in rank 0's file only, buffers under
`"buffer.{name}"`. The metadata holds what is needed to interpret them without model
code: the layouts, dtypes, optimizer hyperparameters, tied aliases and per-file checksums.

Format version 2 added `GroupMeta.rank_sets` (groups sharded over a process group of
their own, such as experts); version 1 checkpoints, which have none, are still read.
Version 3 added the checksum of `metadata.json` itself (see [Note: the metadata's own
checksum]); versions 1 and 2, which have none, are read unchecked. Version 4 added
`GroupMeta.tensor_split` (tensor parallelism: a group's instances are the pieces of one
model). Version 5 added `param_states`: optimizer state kept whole per parameter (a
whole-matrix optimizer's, such as Shampoo's preconditioners), stored in the rank file of
the rank that owned the parameter under `"pstate.{param}/{state}"`. Version 6 added
`optimizers`: the class of the optimizer stepping each param group, so that a load into
another optimizer is refused (versions 1 to 5 have none: their loads compare the param
groups' hyperparameter keys instead). Version 7 lets a group's `rank_sets` leave rank
files out (`GroupMeta.holds`: a file holds the groups whose sets name it; hybrid sharding
with groups of their own, where only the first replica's ranks hold the other groups).
A checkpoint is written as the lowest version that
holds what it has (version 3 without any of these), so earlier builds read what they can.

[Note: the metadata's own checksum]
The last field of `metadata.json` is `"checksum": "crc32:{digest}"`, the crc32 of the
whole file with the digest's 8 characters written as zeros: every byte but those is
covered, the line's own frame and the closing brace included. It is checked on the
bytes, before they are decoded: a flipped bit anywhere is a `ChecksumError`, never a
silently different learning rate or step. A version 3 file without that line (or one
whose line is damaged) is a `ChecksumError` too.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from zeroshard.ckpt._errors import (
    CheckpointError,
    ChecksumError,
    FormatVersionError,
    ModelMismatchError,
)
from zeroshard.ckpt._group_meta import FileMeta, GroupMeta, ParamState, check_json
from zeroshard.ckpt._keys import buffer_key, param_state_key, shard_key
from zeroshard.partition import dtype_from_name, dtype_name

FORMAT_NAME = "zeroshard-ckpt"
FORMAT_VERSION = 7
# Versions this build reads: 1 is 2 without `rank_sets` (every group over the whole world),
# 2 is 3 without the metadata's own checksum, 3 is 4 without `tensor_split`, 4 is 5
# without `param_states`, 5 is 6 without `optimizers`, 6 is 7 with every group in
# every rank file.
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7)
# The first version whose metadata.json carries its own checksum.
CHECKSUMMED_VERSION = 3
# The first version with `tensor_split`, the first with `param_states`, the first with
# `optimizers`, and the one written without any of them.
TENSOR_SPLIT_VERSION = 4
PARAM_STATES_VERSION = 5
OPTIMIZERS_VERSION = 6
PARTIAL_FILES_VERSION = 7
PLAIN_VERSION = 3
_BLANK_DIGEST = b"00000000"
_CHECKSUM_TAIL = re.compile(rb'\n "checksum": "crc32:([0-9a-f]{8})"\n\}\n\Z')


@dataclass(frozen=True)
class CheckpointMeta:
    """What `metadata.json` holds. `save` fills `step` and `files`; the rest is the caller's.

    `param_groups` are the optimizer's hyperparameters per param group (JSON values,
    e.g. `{"lr": 1e-3, "betas": [0.9, 0.999]}`); `tied` maps each alias of a shared
    parameter to its canonical name (the one in a layout); `buffers` names the module
    buffers stored in rank 0's file and `buffer_shapes` their shapes (`save` fills it;
    empty in checkpoints written before it existed); `extra` is free JSON for the caller
    (scheduler state, engine config). `param_states` holds, by parameter name, the
    optimizer state kept whole (a whole-matrix optimizer's). `optimizers` names, per
    param group, the class of the optimizer that steps it (`"torch.optim.adamw.AdamW"`;
    empty: not recorded). `version` is the format version (0: the lowest that holds
    them: `PARTIAL_FILES_VERSION` where a group's rank sets leave rank files out, else
    `OPTIMIZERS_VERSION` with optimizers, else `PARAM_STATES_VERSION` with param
    states, else `TENSOR_SPLIT_VERSION` with a `tensor_split`, else `PLAIN_VERSION`).
    """

    world_size: int
    groups: tuple[GroupMeta, ...]
    stage: int = 3
    step: int = 0
    compute_dtype: torch.dtype = torch.float32
    param_groups: tuple[Mapping[str, Any], ...] = ()
    tied: Mapping[str, str] = field(default_factory=dict)
    buffers: tuple[str, ...] = ()
    files: Mapping[str, FileMeta] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)
    version: int = 0
    buffer_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    param_states: Mapping[str, ParamState] = field(default_factory=dict)
    optimizers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "param_states", dict(self.param_states))
        set_(self, "optimizers", tuple(self.optimizers))
        set_(self, "groups", tuple(self.groups))
        set_(self, "param_groups", tuple(dict(p) for p in self.param_groups))
        set_(self, "tied", dict(self.tied))
        set_(self, "buffers", tuple(self.buffers))
        set_(self, "files", dict(self.files))
        set_(self, "extra", dict(self.extra))
        set_(self, "buffer_shapes", {k: tuple(v) for k, v in self.buffer_shapes.items()})
        split = any(g.tensor_split is not None for g in self.groups)
        if self.version == 0:
            lowest = TENSOR_SPLIT_VERSION if split else PLAIN_VERSION
            lowest = PARAM_STATES_VERSION if self.param_states else lowest
            lowest = OPTIMIZERS_VERSION if self.optimizers else lowest
            set_(self, "version", PARTIAL_FILES_VERSION if self._partial_files() else lowest)
        if self.version not in READABLE_VERSIONS:
            raise FormatVersionError(
                f"checkpoint format version {self.version!r} is not supported "
                f"(this build reads versions {READABLE_VERSIONS})"
            )
        if self.version == 1 and any(g.rank_sets is not None for g in self.groups):
            raise CheckpointError("format version 1 has no rank sets: metadata is malformed")
        if self.version < TENSOR_SPLIT_VERSION and split:
            raise CheckpointError(
                f"format version {self.version} has no tensor splits: metadata is malformed"
            )
        if self.param_states and self.version < PARAM_STATES_VERSION:
            raise CheckpointError(
                f"format version {self.version} has no param states: metadata is malformed"
            )
        if self.version < PARTIAL_FILES_VERSION and self._partial_files():
            raise CheckpointError(
                f"format version {self.version}: every rank file holds every group, yet a "
                "group's rank sets leave ranks out: metadata is malformed"
            )
        if self.optimizers and self.version < OPTIMIZERS_VERSION:
            raise CheckpointError(
                f"format version {self.version} has no optimizers: metadata is malformed"
            )
        if self.optimizers and len(self.optimizers) != len(self.param_groups):
            raise CheckpointError(
                f"{len(self.optimizers)} optimizers recorded for {len(self.param_groups)} "
                "param groups: metadata is malformed"
            )
        if not all(isinstance(o, str) and o for o in self.optimizers):
            raise CheckpointError(f"optimizers must be class names, got {list(self.optimizers)}")
        if self.world_size < 1:
            raise CheckpointError(f"world_size must be >= 1, got {self.world_size}")
        if self.stage not in (0, 1, 2, 3):
            raise CheckpointError(f"stage must be 0, 1, 2 or 3, got {self.stage}")
        if not self.groups:
            raise CheckpointError("a checkpoint needs at least one group")
        check_json("param_groups", list(self.param_groups))
        check_json("extra", self.extra)
        self._check_names()

    def _check_names(self) -> None:
        seen_groups: set[str] = set()
        keys: set[str] = set()
        names: set[str] = set()
        for g in self.groups:
            if g.name in seen_groups:
                raise CheckpointError(f"group name {g.name!r} appears twice")
            seen_groups.add(g.name)
            if g.rank_sets is None and g.layout.world_size != self.world_size:
                raise CheckpointError(
                    f"group {g.name!r}: layout is for world size {g.layout.world_size}, "
                    f"the checkpoint for {self.world_size}"
                )
            if g.rank_sets is not None and max(max(s) for s in g.rank_sets) >= self.world_size:
                raise CheckpointError(
                    f"group {g.name!r}: a rank set names a rank outside the "
                    f"checkpoint's {self.world_size}"
                )
            pg = g.param_group
            if pg is not None and self.param_groups and not 0 <= pg < len(self.param_groups):
                raise CheckpointError(
                    f"group {g.name!r}: param_group {pg} out of range "
                    f"({len(self.param_groups)} optimizer param groups)"
                )
            for kind in g.shards:
                key = shard_key(g.name, kind)
                if key in keys:
                    raise CheckpointError(f"shard key {key!r} is ambiguous")
                keys.add(key)
            for s in g.layout.slots:
                if s.name in names:
                    raise CheckpointError(f"parameter {s.name!r} appears in two groups")
                names.add(s.name)
        for b in self.buffers:
            if b in names or buffer_key(b) in keys:
                raise CheckpointError(f"buffer {b!r} clashes with a parameter or shard key")
            names.add(b)
        for alias, canonical in self.tied.items():
            if alias in names:
                raise CheckpointError(f"tied alias {alias!r} is also a stored name")
            if canonical not in names:
                raise CheckpointError(f"tied alias {alias!r} points at unknown {canonical!r}")
        trainable = {s.name for g in self.groups if g.requires_grad for s in g.layout.slots}
        for name, ps in self.param_states.items():
            if name not in trainable:
                raise CheckpointError(f"param state of {name!r}, which is no trainable parameter")
            if not 0 <= ps.rank < self.world_size:
                raise CheckpointError(
                    f"param state of {name!r} is in rank file {ps.rank}, of {self.world_size}"
                )

    @property
    def frozen(self) -> tuple[str, ...]:
        """Names of the frozen parameters (those of groups with `requires_grad=False`)."""
        return tuple(s.name for g in self.groups if not g.requires_grad for s in g.layout.slots)

    @property
    def param_names(self) -> tuple[str, ...]:
        """Every stored parameter name in layout order (aliases excluded)."""
        return tuple(s.name for g in self.groups for s in g.layout.slots)

    @property
    def num_params(self) -> int:
        """Number of parameter elements (aliases counted once, padding not counted, a
        tensor-parallel parameter whole)."""
        return sum(math.prod(g.full_shape(s)) for g in self.groups for s in g.layout.slots)

    def group(self, name: str) -> GroupMeta:
        """A group by name."""
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"no group {name!r} in this checkpoint")

    def _partial_files(self) -> bool:
        """Whether a group's rank sets leave some rank file out."""
        return any(not all(g.holds(r) for r in range(self.world_size)) for g in self.groups)

    def shard_keys(self, rank: int) -> Iterator[tuple[GroupMeta, str, str]]:
        """Every (group, kind, key) that rank file `rank` holds."""
        for g in self.groups:
            if not g.holds(rank):
                continue
            for kind in g.shards:
                yield g, kind, shard_key(g.name, kind)

    def with_files(
        self,
        step: int,
        files: Mapping[str, FileMeta],
        buffer_shapes: Mapping[str, tuple[int, ...]] | None = None,
    ) -> CheckpointMeta:
        """A copy with the step, file checksums and buffer shapes set (what `save` writes)."""
        return replace(self, step=step, files=dict(files), buffer_shapes=buffer_shapes or {})

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "format": FORMAT_NAME,
            "version": self.version,
            "world_size": self.world_size,
            "stage": self.stage,
            "step": self.step,
            "compute_dtype": dtype_name(self.compute_dtype),
            "groups": [g.to_dict() for g in self.groups],
            "param_groups": [dict(p) for p in self.param_groups],
            "tied": dict(self.tied),
            "frozen": list(self.frozen),
            "buffers": list(self.buffers),
            "buffer_shapes": {k: list(v) for k, v in self.buffer_shapes.items()},
            "files": {
                n: {"bytes": f.size, "algorithm": f.algorithm, "digest": f.digest}
                for n, f in sorted(self.files.items())
            },
            "extra": dict(self.extra),
            **(
                {"param_states": {n: ps.to_dict() for n, ps in self.param_states.items()}}
                if self.param_states
                else {}
            ),
            **({"optimizers": list(self.optimizers)} if self.optimizers else {}),
        }

    def to_json(self) -> str:
        """The metadata as JSON text: one top-level field per line, one group per line,
        the checksum last (see [Note: the metadata's own checksum])."""
        lines = []
        for k, v in self.to_dict().items():
            if k == "groups":
                inner = ",\n  ".join(json.dumps(g, separators=(",", ":")) for g in v)
                text = f"[\n  {inner}\n ]"
            else:
                text = json.dumps(v, separators=(",", ":"))
            lines.append(f" {json.dumps(k)}: {text}")
        head = "{\n" + ",\n".join(lines) + ',\n "checksum": "crc32:'
        tail = '"\n}\n'
        blank = (head + _BLANK_DIGEST.decode() + tail).encode()
        return f"{head}{zlib.crc32(blank):08x}{tail}"

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> CheckpointMeta:
        """Read `to_dict()` output; FormatVersionError for another version, CheckpointError else."""
        if d.get("format") != FORMAT_NAME:
            raise CheckpointError(
                f"not a {FORMAT_NAME} metadata file (format field is {d.get('format')!r})"
            )
        version = d.get("version")
        if version not in READABLE_VERSIONS:
            raise FormatVersionError(
                f"checkpoint format version {version!r} is not supported "
                f"(this build of zeroshard-ckpt reads versions {READABLE_VERSIONS}); "
                "upgrade zeroshard-ckpt to read it"
            )
        if d.get("param_states") and version < PARAM_STATES_VERSION:
            # Read as written: a version 3 file with param states is malformed, not new.
            raise CheckpointError(
                f"format version {version} has no param states: metadata is malformed"
            )
        if d.get("optimizers") and version < OPTIMIZERS_VERSION:
            raise CheckpointError(
                f"format version {version} has no optimizers: metadata is malformed"
            )
        try:
            meta = CheckpointMeta(
                world_size=int(d["world_size"]),
                groups=tuple(GroupMeta.from_dict(g) for g in d["groups"]),
                stage=int(d["stage"]),
                step=int(d["step"]),
                compute_dtype=dtype_from_name(str(d["compute_dtype"])),
                param_groups=tuple(dict(p) for p in d["param_groups"]),
                tied={str(a): str(c) for a, c in d["tied"].items()},
                buffers=tuple(str(b) for b in d["buffers"]),
                buffer_shapes={
                    str(b): tuple(int(x) for x in shape)
                    for b, shape in d.get("buffer_shapes", {}).items()
                },
                files={
                    str(n): FileMeta(int(f["bytes"]), str(f["digest"]), str(f["algorithm"]))
                    for n, f in d["files"].items()
                },
                extra=dict(d.get("extra", {})),
                version=int(version),
                param_states={
                    str(n): ParamState.from_dict(ps) for n, ps in d.get("param_states", {}).items()
                },
                optimizers=tuple(_names(d.get("optimizers", []))),
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"malformed checkpoint metadata: missing or bad {e}") from e
        except ValueError as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"malformed checkpoint metadata: {e}") from e
        if sorted(meta.frozen) != sorted(str(n) for n in d.get("frozen", meta.frozen)):
            raise CheckpointError("metadata 'frozen' list disagrees with the groups")
        return meta

    @staticmethod
    def from_json(text: str) -> CheckpointMeta:
        """Parse `to_json()` output."""
        return CheckpointMeta.from_bytes(text.encode())

    @staticmethod
    def from_bytes(data: bytes) -> CheckpointMeta:
        """Parse the bytes of a `metadata.json`, its checksum checked first (see [Note:
        the metadata's own checksum]): ChecksumError if they are damaged."""
        found = _CHECKSUM_TAIL.search(data)
        if found is not None:
            digest = found.group(1).decode()
            blank = data[: found.start(1)] + _BLANK_DIGEST + data[found.end(1) :]
            if f"{zlib.crc32(blank):08x}" != digest:
                raise ChecksumError(
                    f"metadata's crc32 is {zlib.crc32(blank):08x}, its checksum line says "
                    f"{digest}: the file is damaged (or was edited by hand)"
                )
        try:
            d = json.loads(data.decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ChecksumError(f"metadata is not valid JSON (the file is damaged): {e}") from e
        if not isinstance(d, dict):
            raise ChecksumError("metadata is not a JSON object (the file is damaged)")
        version = d.get("version")
        if found is None and version in READABLE_VERSIONS and version >= CHECKSUMMED_VERSION:
            raise ChecksumError(
                f"metadata of format version {version} has no intact checksum line: the "
                "file is damaged (or was edited by hand)"
            )
        return CheckpointMeta.from_dict(d)


def _names(value: Any) -> list[str]:
    if not isinstance(value, list):
        raise CheckpointError(f"optimizers must be a list of class names, got {value!r}")
    return value


def expected_shard_keys(meta: CheckpointMeta, rank: int) -> dict[str, tuple[torch.dtype, int]]:
    """Key -> (dtype, numel) of the shard tensors rank file `rank` stores (buffers excluded)."""
    return {key: (g.shards[kind], g.layout.shard_numel) for g, kind, key in meta.shard_keys(rank)}


def param_state_keys(
    meta: CheckpointMeta, rank: int
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Key -> (dtype, shape) of the whole-parameter state tensors rank file `rank` stores."""
    return {
        param_state_key(name, key): (dtype, shape)
        for name, ps in meta.param_states.items()
        if ps.rank == rank
        for key, (dtype, shape, _) in ps.tensors.items()
    }


def check_names_shapes(
    have: Mapping[str, Sequence[int]], expected: Mapping[str, Sequence[int]], what: str
) -> None:
    """Raise ModelMismatchError listing missing, unexpected and reshaped names."""
    missing = sorted(set(expected) - set(have))
    unexpected = sorted(set(have) - set(expected))
    shapes = sorted(
        f"{n}: checkpoint {tuple(have[n])} vs model {tuple(expected[n])}"
        for n in set(have) & set(expected)
        if tuple(have[n]) != tuple(expected[n])
    )
    if not (missing or unexpected or shapes):
        return

    def cut(xs: list[str]) -> str:
        return ", ".join(xs[:10]) + (f", ... ({len(xs)} in all)" if len(xs) > 10 else "")

    parts = []
    if missing:
        parts.append(f"missing from the checkpoint: {cut(missing)}")
    if unexpected:
        parts.append(f"not in the model: {cut(unexpected)}")
    if shapes:
        parts.append(f"shape mismatch: {cut(shapes)}")
    raise ModelMismatchError(f"{what} is of another model; " + "; ".join(parts))
