"""The streamed safetensors writer: headers first, then workers fill tensors at offsets.

[Note: bounded memory]
Each worker task takes one buffer from a shared `BufferPool`, has the spec fill it
(`read`, or `read_range` for a `RangeSpec` chunk), casts it if asked, `os.pwrite`s it
at its planned offset and gives the buffer back. The pool bounds the bytes of all
buffers together (`max_buffer_bytes`, 1 GiB by default; see [Note: bytes in flight]),
whatever the number of workers, and big tensors are split into chunks of a fair share
of that bound per worker (at most 64 MiB), so every worker has work. Reads and writes
release the GIL, so threads give real parallelism.

[Note: write-back overlaps the copy]
After each big task's `pwrite` the kernel is asked to start writing those pages
(`sync_file_range`, Linux), so the disk works while the workers copy; the one fsync
per file at the end remains, for durability, but finds little left to write.

[Note: nothing claims to be complete early]
Files are written under a temporary name next to the output (`.NAME.tmp-PID`) and
renamed into place only after every byte is written, fsynced and (optionally)
verified. On any error, disk full included, the temporary output is removed; a
SIGKILL leaves only the '.'-prefixed temporary name.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from zeroshard.ckpt._buffers import BufferPool
from zeroshard.ckpt._errors import CheckpointError, OutputExistsError
from zeroshard.ckpt._plan import (
    INDEX_FILE,
    OutputPlan,
    PlannedFile,
    index_text,
    output_dtype,
    plan_output,
)
from zeroshard.ckpt._spec import TensorSpec
from zeroshard.ckpt._stfile import fsync_dir, pwrite_all, start_writeback, tensor_bytes
from zeroshard.ckpt._verify import verify_output

MIB = 1024 * 1024
DEFAULT_BUFFER_BYTES = 1024 * MIB  # all workers' buffers together
LOW_MEMORY_BUFFER_BYTES = 32 * MIB
DEFAULT_CHUNK_BYTES = 64 * MIB  # the most one chunk task holds (source + cast)
LOW_MEMORY_CHUNK_BYTES = 8 * MIB
MIN_CHUNK_BYTES = 1 * MIB  # below this, more workers wait for buffers instead
WRITEBACK_MIN_BYTES = 1 * MIB  # smaller tasks are left to the final fsync
PAGE = 4096


@dataclass(frozen=True)
class RangeSpec(TensorSpec):
    """A `TensorSpec` that can also read part of its tensor, so big ones are split up.

    `read_range(start, out)` fills `out` with flat elements [start, start + out.numel()).
    """

    read_range: Callable[[int, torch.Tensor], None]


@dataclass(frozen=True)
class WriteResult:
    """What a consolidation wrote."""

    path: Path
    files: tuple[Path, ...]
    tensors: int
    bytes: int
    seconds: float
    verified: bool
    peak_buffer_bytes: int = 0  # most host buffer bytes held at once (see BufferPool)


def default_workers() -> int:
    """All cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _reserve(fd: int, size: int) -> None:
    """Allocate the file's blocks up front so a full disk fails now, not half way."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        fallocate = libc.fallocate
        fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        if fallocate(fd, 0, 0, size) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise OSError(err, os.strerror(err))
    os.ftruncate(fd, size)  # file systems without fallocate: a sparse file


@dataclass(frozen=True)
class _Task:
    fd: int
    offset: int
    spec: TensorSpec
    start: int
    numel: int
    out_dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes written to the output."""
        return self.numel * self.out_dtype.itemsize

    @property
    def buffer_bytes(self) -> int:
        """Host bytes the task holds: the source elements, plus their cast if casting."""
        return self.numel * _bytes_per_element(self.spec.dtype, self.out_dtype)


def _bytes_per_element(src: torch.dtype, out: torch.dtype) -> int:
    return src.itemsize + (out.itemsize if out != src else 0)


def chunk_bytes(limit: int, workers: int, low_memory: bool) -> int:
    """Host bytes one chunk task may hold: a fair share of `limit` per worker, between
    MIN_CHUNK_BYTES and 64 MiB (8 MiB with `low_memory`), never above `limit`."""
    cap = LOW_MEMORY_CHUNK_BYTES if low_memory else DEFAULT_CHUNK_BYTES
    return max(1, min(limit, cap, max(MIN_CHUNK_BYTES, limit // max(1, workers))))


def _tasks(
    files: Sequence[PlannedFile], fds: Sequence[int], dtype: torch.dtype | None, chunk: int
) -> list[_Task]:
    tasks: list[_Task] = []
    for f, fd in zip(files, fds, strict=True):
        for s in f.specs:
            out = output_dtype(s, dtype)
            offset = f.header.entries[s.name].offset
            step = max(1, chunk // _bytes_per_element(s.dtype, out))
            if not isinstance(s, RangeSpec) or s.numel <= step:
                tasks.append(_Task(fd, offset, s, 0, s.numel, out))
                continue
            for start in range(0, s.numel, step):
                n = min(step, s.numel - start)
                tasks.append(_Task(fd, offset + start * out.itemsize, s, start, n, out))
    # Biggest first: the pool then ends with small tasks and all workers finish together.
    tasks.sort(key=lambda t: -t.nbytes)
    return tasks


def _fill(task: _Task, pool: BufferPool) -> int:
    raw = pool.take(task.buffer_bytes)
    try:
        _copy(task, raw)
    finally:
        pool.give(raw)  # after _copy returned: no view of `raw` is left
    # The bytes are in the page cache now; have the kernel start writing them to disk
    # while the workers go on copying, so the final fsync finds little left to do. Only
    # whole pages of big tasks: a page shared with a neighbouring tensor would be written
    # twice (and a write to a page under write-back may wait for it).
    if task.nbytes >= WRITEBACK_MIN_BYTES:
        lo = -(-task.offset // PAGE) * PAGE
        hi = (task.offset + task.nbytes) // PAGE * PAGE
        start_writeback(task.fd, lo, hi - lo)
    return task.nbytes


def _copy(task: _Task, raw: torch.Tensor) -> None:
    src_dtype, out_dtype = task.spec.dtype, task.out_dtype
    src_n, out_n = task.numel * src_dtype.itemsize, task.numel * out_dtype.itemsize
    # Source and cast share one buffer; the wider dtype goes first so that both views
    # start at a multiple of their item size (item sizes are powers of two).
    if out_dtype == src_dtype:
        src, out = raw[:src_n], raw[:src_n]
    elif src_dtype.itemsize >= out_dtype.itemsize:
        src, out = raw[:src_n], raw[src_n : src_n + out_n]
    else:
        out, src = raw[:out_n], raw[out_n : out_n + src_n]
    src_t, out_t = src.view(src_dtype), out.view(out_dtype)
    if isinstance(task.spec, RangeSpec):
        task.spec.read_range(task.start, src_t)
    else:
        task.spec.read(src_t)
    if out_dtype != src_dtype:
        out_t.copy_(src_t)
    pwrite_all(task.fd, tensor_bytes(out_t), task.offset)


def _write_files(
    plan: OutputPlan,
    where: Path,
    dtype: torch.dtype | None,
    workers: int,
    buffers: BufferPool,
    progress: bool,
) -> list[Path]:
    paths = [where / f.name for f in plan.files]
    fds: list[int] = []
    try:
        for f, path in zip(plan.files, paths, strict=True):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            fds.append(fd)
            _reserve(fd, f.header.size)
            pwrite_all(fd, memoryview(f.head), 0)
        tasks = _tasks(plan.files, fds, dtype, buffers.keep)
        lock = threading.Lock()
        with tqdm(
            total=plan.total_bytes,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc="consolidate",
            disable=not progress,
        ) as bar:

            def work(task: _Task) -> None:
                n = _fill(task, buffers)
                with lock:
                    bar.update(n)

            with ThreadPoolExecutor(max(1, workers), thread_name_prefix="zs-consolidate") as pool:
                futures = [pool.submit(work, t) for t in tasks]
                try:
                    for fut in futures:
                        fut.result()
                except BaseException:
                    for fut in futures:
                        fut.cancel()
                    raise
        buffers.clear()  # the data is written: give the memory back before the fsync
        for fd in fds:
            os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)
    if plan.index is not None:
        with open(where / INDEX_FILE, "w") as fh:
            fh.write(index_text(plan.index))
            fh.flush()
            os.fsync(fh.fileno())
        paths.append(where / INDEX_FILE)
    return paths


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def write_safetensors(
    specs: Sequence[TensorSpec],
    out: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: int | None = None,
    workers: int | None = None,
    low_memory: bool = False,
    max_buffer_bytes: int | None = None,
    overwrite: bool = False,
    verify: bool = False,
    progress: bool = False,
    metadata: Mapping[str, str] | None = None,
) -> WriteResult:
    """Write the specs' tensors as safetensors: a single file if `out` ends in .safetensors,
    else a directory with `model.safetensors` or Hugging Face shards plus an index.

    `dtype` casts floating tensors. Streamed: at most `max_buffer_bytes` (default 1 GiB)
    of tensor data in host memory at once, for any `workers` (see [Note: bounded
    memory]); `low_memory` lowers that to 32 MiB in 8 MiB chunks. A tensor whose spec is
    no `RangeSpec` is read whole, alone if it is bigger than the bound. `verify` re-reads
    the output with the safetensors library and compares every tensor with its source.
    """
    began = time.perf_counter()
    out = Path(out)
    single = out.suffix == ".safetensors"
    if single and max_shard_size is not None:
        raise CheckpointError(
            f"{out} is one .safetensors file; give a directory to split at max_shard_size"
        )
    if not specs:
        raise CheckpointError("nothing to write: no tensors selected")
    if max_buffer_bytes is not None and max_buffer_bytes < 1:
        raise CheckpointError(f"max_buffer_bytes must be >= 1, got {max_buffer_bytes}")
    if out.exists() and not overwrite:
        raise OutputExistsError(f"{out} exists; pass --overwrite (overwrite=True) to replace it")
    meta = {"format": "pt", **(metadata or {})}
    plan = plan_output(
        specs,
        dtype=dtype,
        max_shard_size=max_shard_size,
        metadata=meta,
        single_name=out.name if single else "model.safetensors",
    )
    parent = out.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f".{out.name}.tmp-{os.getpid()}"
    _remove(tmp)
    workers = workers or default_workers()
    limit = max_buffer_bytes or DEFAULT_BUFFER_BYTES
    if low_memory:
        limit = min(limit, LOW_MEMORY_BUFFER_BYTES)
    buffers = BufferPool(limit, keep=chunk_bytes(limit, workers, low_memory))
    try:
        tmp.mkdir()
        files = _write_files(plan, tmp, dtype, workers, buffers, progress)
        fsync_dir(tmp)
        if verify:
            verify_output(plan, tmp, dtype, workers)
        final = _commit(tmp, out, single, overwrite)
    except OSError as e:
        _remove(tmp)
        raise CheckpointError(
            f"writing {out} failed ({e.strerror or e}); nothing was left at {out}"
        ) from e
    except BaseException:
        _remove(tmp)
        raise
    names = [f.name for f in files]
    paths = (out,) if single else tuple(out / n for n in names)
    seconds = time.perf_counter() - began
    return WriteResult(final, paths, len(specs), plan.total_bytes, seconds, verify, buffers.peak)


def _commit(tmp: Path, out: Path, single: bool, overwrite: bool) -> Path:
    """Move the finished output into place (replacing the old one only if asked)."""
    if out.exists() and not overwrite:
        raise OutputExistsError(f"{out} appeared while writing; pass --overwrite")
    if single:
        os.replace(tmp / out.name, out)
        fsync_dir(out.parent)
        shutil.rmtree(tmp, ignore_errors=True)
        return out
    if out.is_dir():
        _replace_weights(tmp, out)
    elif out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, old)
        os.rename(tmp, out)
        _remove(old)
    else:
        os.rename(tmp, out)
    fsync_dir(out.parent)
    return out


_WEIGHT_FILE = re.compile(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?")


def _replace_weights(tmp: Path, out: Path) -> None:
    """Overwrite into an existing folder: replace only weight files, keep everything else.

    A model folder also holds config.json, tokenizer files and the like, which we never
    wrote and must not delete. Each new file is renamed over its old name (atomic per
    file), the index last, so a crash part way leaves complete files the old index can
    still read; old weight files the new output does not have go only after that.
    """
    new = sorted(p.name for p in tmp.iterdir())
    for name in sorted(new, key=lambda n: n.endswith(".json")):
        os.replace(tmp / name, out / name)
    fsync_dir(out)
    for stale in out.iterdir():
        if stale.name not in new and _WEIGHT_FILE.fullmatch(stale.name):
            stale.unlink()
    fsync_dir(out)
    shutil.rmtree(tmp, ignore_errors=True)
