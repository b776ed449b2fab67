"""`CheckpointReader`: one committed checkpoint, its rank files opened lazily, read by range.

Reads go through `os.preadv` straight into the destination tensor: only the bytes a
caller asks for are read, no intermediate copy is made, the GIL is released during
the read (so threads read in parallel), and the process's resident memory does not
grow with the size of the files (a memory map's touched pages would count).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

import torch

from zeroshard.ckpt._errors import CheckpointError, ChecksumError, MissingShardError
from zeroshard.ckpt._group_meta import GroupMeta
from zeroshard.ckpt._keys import buffer_key, param_state_key, rank_file, shard_key
from zeroshard.ckpt._meta import CheckpointMeta, expected_shard_keys, param_state_keys
from zeroshard.ckpt._paths import METADATA, resolve
from zeroshard.ckpt._stfile import Entry, Header, file_digest, pread_into, read_header


def read_meta(directory: Path) -> CheckpointMeta:
    """The metadata of a checkpoint directory."""
    try:
        data = (directory / METADATA).read_bytes()
    except FileNotFoundError:
        raise MissingShardError(f"{directory / METADATA} is missing") from None
    try:
        return CheckpointMeta.from_bytes(data)
    except CheckpointError as e:
        raise type(e)(f"{directory / METADATA}: {e}") from None


class CheckpointReader:
    """A committed checkpoint (`path` a checkpoint dir, or a root plus `tag` / `step`)."""

    def __init__(
        self, path: str | os.PathLike[str], *, tag: str | None = None, step: int | None = None
    ) -> None:
        self.path = resolve(Path(path), tag, step)
        self.meta = read_meta(self.path)
        names = {rank_file(r) for r in range(self.meta.world_size)}
        if set(self.meta.files) != names:
            raise CheckpointError(
                f"{self.path / METADATA}: 'files' lists {sorted(self.meta.files)}, "
                f"expected {sorted(names)}"
            )
        self._fds: dict[int, int] = {}
        self._headers: dict[int, Header] = {}
        self._verified: set[int] = set()
        self._lock = threading.Lock()

    def file(self, rank: int) -> Path:
        """Path of a rank's file."""
        return self.path / rank_file(rank)

    def check_present(self, ranks: Iterable[int] | None = None) -> None:
        """MissingShardError listing every missing rank file (all ranks by default)."""
        wanted = range(self.meta.world_size) if ranks is None else ranks
        missing = [rank_file(r) for r in sorted(set(wanted)) if not self.file(r).is_file()]
        if missing:
            raise MissingShardError(
                f"checkpoint {self.path} is incomplete: missing {', '.join(missing)}"
            )

    def verify(self, ranks: Iterable[int] | None = None, workers: int = 4) -> None:
        """Check size and checksum of rank files (all by default), in parallel threads."""
        todo = sorted(set(range(self.meta.world_size) if ranks is None else ranks))
        todo = [r for r in todo if r not in self._verified]
        self.check_present(todo)

        def one(rank: int) -> None:
            want = self.meta.files[rank_file(rank)]
            path = self.file(rank)
            size = path.stat().st_size
            if size != want.size:
                raise ChecksumError(
                    f"{path}: {size} bytes, metadata.json says {want.size} "
                    f"({'truncated' if size < want.size else 'extended'} file)"
                )
            got = file_digest(path, want.algorithm)
            if got.digest != want.digest:
                raise ChecksumError(
                    f"{path}: {want.algorithm} is {got.digest}, metadata.json says "
                    f"{want.digest} (the file is corrupted)"
                )

        with ThreadPoolExecutor(max(1, min(workers, len(todo)))) as pool:
            list(pool.map(one, todo))
        self._verified.update(todo)

    def header(self, rank: int) -> Header:
        """Rank file's header, checked against the metadata (keys, dtypes, sizes)."""
        with self._lock:
            if rank in self._headers:
                return self._headers[rank]
            path = self.file(rank)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise MissingShardError(
                    f"checkpoint {self.path} is incomplete: missing {path.name}"
                ) from None
            try:
                header = read_header(fd, path)
                self._check(rank, header, os.fstat(fd).st_size)
            except BaseException:
                os.close(fd)
                raise
            self._fds[rank] = fd
            self._headers[rank] = header
            return header

    def _check(self, rank: int, header: Header, size: int) -> None:
        path = self.file(rank)
        want = self.meta.files[rank_file(rank)].size
        if size != want:
            raise ChecksumError(f"{path}: {size} bytes, metadata.json says {want} (truncated?)")
        problems = []
        for key, (dtype, numel) in expected_shard_keys(self.meta, rank).items():
            e = header.entries.get(key)
            if e is None:
                problems.append(f"no tensor {key!r}")
            elif e.dtype != dtype or e.shape != (numel,):
                problems.append(f"{key!r} is {e.dtype} {e.shape}, expected {dtype} ({numel},)")
        for key, (dtype, shape) in param_state_keys(self.meta, rank).items():
            e = header.entries.get(key)
            if e is None:
                problems.append(f"no tensor {key!r}")
            elif e.dtype != dtype or tuple(e.shape) != shape:
                problems.append(f"{key!r} is {e.dtype} {e.shape}, expected {dtype} {shape}")
        if rank == 0:
            problems += [
                f"no buffer {b!r}" for b in self.meta.buffers if buffer_key(b) not in header.entries
            ]
        if problems:
            raise CheckpointError(f"{path} disagrees with metadata.json: " + "; ".join(problems))

    def buffer_entry(self, name: str) -> Entry:
        """Dtype and shape of a buffer (from rank 0's header, checked against metadata.json)."""
        entry = self.header(0).entries[buffer_key(name)]
        want = self.meta.buffer_shapes.get(name)
        # A reshape that keeps the element count would otherwise pass every size check.
        if want is not None and tuple(entry.shape) != want:
            raise CheckpointError(
                f"{self.file(0)}: buffer {name!r} has shape {tuple(entry.shape)}, "
                f"metadata.json says {want}"
            )
        return entry

    def read_entry(self, rank: int, key: str, start: int, out: torch.Tensor) -> None:
        """Elements [start, start + out.numel()) of tensor `key` of a rank file, into `out`."""
        entry = self.header(rank).entries[key]
        if out.dtype != entry.dtype or start + out.numel() > entry.numel:
            raise ValueError(f"bad read of {key!r}: {out.dtype}[{start}:+{out.numel()}]")
        offset = entry.offset + start * entry.dtype.itemsize
        pread_into(self._fds[rank], out, offset, self.file(rank))

    def read_flat(
        self,
        group: GroupMeta,
        kind: str,
        lo: int,
        hi: int,
        out: torch.Tensor,
        instance: int = 0,
    ) -> None:
        """Elements [lo, hi) of a group's padded flat buffer of one kind (of one instance,
        for a group on its own process group: see `GroupMeta.rank_sets`), into `out`."""
        n = group.layout.shard_numel
        key = shard_key(group.name, kind)
        if hi <= lo:
            return
        for r in range(lo // n, (hi - 1) // n + 1):
            a, b = max(lo, r * n), min(hi, (r + 1) * n)
            self.read_entry(group.file_rank(instance, r), key, a - r * n, out[a - lo : b - lo])

    def read_param_state(self, name: str) -> dict[str, torch.Tensor]:
        """Parameter `name`'s whole-parameter state tensors (`CheckpointMeta.param_states`)."""
        ps = self.meta.param_states[name]
        out = {}
        for key, (dtype, shape, _) in ps.tensors.items():
            t = torch.empty(shape, dtype=dtype)
            self.read_entry(ps.rank, param_state_key(name, key), 0, t.view(-1))
            out[key] = t
        return out

    def read_buffer(self, name: str) -> torch.Tensor:
        """A module buffer, whole."""
        e = self.buffer_entry(name)
        out = torch.empty(e.shape, dtype=e.dtype)
        self.read_entry(0, buffer_key(name), 0, out.view(-1))
        return out

    def close(self) -> None:
        """Close the open rank files."""
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._headers.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
