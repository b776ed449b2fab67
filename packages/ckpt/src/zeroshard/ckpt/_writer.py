"""The streamed safetensors writer: headers first, then workers fill tensors at offsets.

[Note: bounded memory]
Each worker task allocates one buffer, has the spec fill it (`read`, or `read_range`
for a `RangeSpec` chunk), casts it if asked, `os.pwrite`s it at its planned offset
and drops it. Tasks are created lazily by the thread pool, so at most `workers`
buffers exist at once: peak memory is about workers x the largest tensor (x the
chunk size for `RangeSpec`s, which big tensors are split into). Reads and writes
release the GIL, so threads give real parallelism.

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
from zeroshard.ckpt._stfile import fsync_dir, pwrite_all, tensor_bytes
from zeroshard.ckpt._verify import verify_output

DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024
LOW_MEMORY_CHUNK_BYTES = 8 * 1024 * 1024


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
        return self.numel * self.out_dtype.itemsize


def _tasks(
    files: Sequence[PlannedFile], fds: Sequence[int], dtype: torch.dtype | None, chunk: int
) -> list[_Task]:
    tasks: list[_Task] = []
    for f, fd in zip(files, fds, strict=True):
        for s in f.specs:
            out = output_dtype(s, dtype)
            offset = f.header.entries[s.name].offset
            step = max(1, chunk // max(s.dtype.itemsize, out.itemsize))
            if not isinstance(s, RangeSpec) or s.numel <= step:
                tasks.append(_Task(fd, offset, s, 0, s.numel, out))
                continue
            for start in range(0, s.numel, step):
                n = min(step, s.numel - start)
                tasks.append(_Task(fd, offset + start * out.itemsize, s, start, n, out))
    # Biggest first: the pool then ends with small tasks and all workers finish together.
    tasks.sort(key=lambda t: -t.nbytes)
    return tasks


class _Scratch(threading.local):
    """Per-thread reusable bytes for chunk tasks: a fresh 64 MiB buffer per chunk would
    be page-faulted (and zeroed by the kernel) every time, a cost comparable to the copy."""

    def __init__(self) -> None:
        self.bufs: dict[int, torch.Tensor] = {}

    def get(self, slot: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        buf = self.bufs.get(slot)
        if buf is None or buf.numel() < nbytes:
            buf = self.bufs[slot] = torch.empty(nbytes, dtype=torch.uint8)
        return buf[:nbytes].view(dtype)


def _run(task: _Task, whole_gate: threading.Semaphore | None, scratch: _Scratch) -> int:
    if whole_gate is not None and not isinstance(task.spec, RangeSpec):
        with whole_gate:
            return _fill(task, None)
    return _fill(task, scratch)


def _fill(task: _Task, scratch: _Scratch | None) -> int:
    ranged = isinstance(task.spec, RangeSpec)
    # Whole-tensor tasks allocate and free their buffer (memory bound: workers x the
    # largest tensor); chunk tasks reuse this thread's scratch.
    if ranged and scratch is not None:
        buf = scratch.get(0, task.numel, task.spec.dtype)
    else:
        buf = torch.empty(task.numel, dtype=task.spec.dtype)
    if isinstance(task.spec, RangeSpec):
        task.spec.read_range(task.start, buf)
    else:
        task.spec.read(buf)
    if buf.dtype != task.out_dtype:
        if ranged and scratch is not None:
            buf = scratch.get(1, task.numel, task.out_dtype).copy_(buf)
        else:
            buf = buf.to(task.out_dtype)
    pwrite_all(task.fd, tensor_bytes(buf), task.offset)
    return task.nbytes


def _write_files(
    plan: OutputPlan,
    where: Path,
    dtype: torch.dtype | None,
    workers: int,
    low_memory: bool,
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
        chunk = LOW_MEMORY_CHUNK_BYTES if low_memory else DEFAULT_CHUNK_BYTES
        tasks = _tasks(plan.files, fds, dtype, chunk)
        gate = threading.Semaphore(1) if low_memory else None
        lock = threading.Lock()
        scratch = _Scratch()
        with tqdm(
            total=plan.total_bytes,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc="consolidate",
            disable=not progress,
        ) as bar:

            def work(task: _Task) -> None:
                n = _run(task, gate, scratch)
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
    overwrite: bool = False,
    verify: bool = False,
    progress: bool = False,
    metadata: Mapping[str, str] | None = None,
) -> WriteResult:
    """Write the specs' tensors as safetensors: a single file if `out` ends in .safetensors,
    else a directory with `model.safetensors` or Hugging Face shards plus an index.

    `dtype` casts floating tensors. Streamed and bounded (see [Note: bounded memory]);
    `low_memory` lowers the bound to about one tensor. `verify` re-reads the output with
    the safetensors library and compares every tensor with its source, bit for bit.
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
    try:
        tmp.mkdir()
        files = _write_files(plan, tmp, dtype, workers, low_memory, progress)
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
    return WriteResult(
        final, paths, len(specs), plan.total_bytes, time.perf_counter() - began, verify
    )


def _commit(tmp: Path, out: Path, single: bool, overwrite: bool) -> Path:
    """Move the finished output into place (replacing the old one only if asked)."""
    if out.exists() and not overwrite:
        raise OutputExistsError(f"{out} appeared while writing; pass --overwrite")
    if single:
        os.replace(tmp / out.name, out)
        fsync_dir(out.parent)
        shutil.rmtree(tmp, ignore_errors=True)
        return out
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, old)
        os.rename(tmp, out)
        _remove(old)
    else:
        os.rename(tmp, out)
    fsync_dir(out.parent)
    return out
