"""`save`: every rank writes its shards; rank 0 commits the checkpoint atomically.

[Note: commit protocol]
1. Every rank checks its tensors against the metadata; rank 0 clears and creates
   `root/.{name}.tmp`. An all-gather of failure flags (also a barrier) stops every
   rank if any one failed, before a byte is written.
2. Every rank writes `rank{r:05d}.safetensors` into the temp directory, computing its
   crc32 while writing, and fsyncs the file and the directory.
3. Commit: an all-gather of (failed, size, crc32) from every rank. Rank 0 writes
   `metadata.json` with the checksums, fsyncs it, renames the temp directory to
   `root/{name}`, fsyncs the root, then replaces the `latest` pointer (temp file,
   fsync, rename). A last all-gather tells every rank the commit is done.
A SIGKILL before the directory rename leaves only a '.'-prefixed temp directory
(never a checkpoint); after it, a complete one. `latest` moves last, so it always
names a complete checkpoint.

[Note: async save and collectives]
With `async_save=True` the shards are copied to host memory (pinned for CUDA, on the
current stream, so later in-place updates cannot race the copy) and a background
thread writes the file (step 2). The thread does no collective: on one process group
collectives must be issued in the same order on every rank, and a thread racing the
training loop's collectives would break that. The commit (step 3) therefore runs on
the main thread, in `SaveHandle.wait()` or at the start of the next `save`; call
either on every rank at the same point of the program. A save still pending when the
interpreter exits is committed by an `atexit` hook (every rank exits through it); if
that fails (the process group is gone already) the exit status is 1, with a message.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

import torch

from zeroshard.ckpt._errors import CHECKPOINT_ERRORS, CheckpointError, OutputExistsError
from zeroshard.ckpt._extra import RankExtra, extra_entries
from zeroshard.ckpt._group_meta import FileMeta
from zeroshard.ckpt._keys import EXTRA_METADATA, buffer_key, rank_file
from zeroshard.ckpt._meta import CheckpointMeta, expected_shard_keys, param_state_keys
from zeroshard.ckpt._paths import (
    LATEST,
    METADATA,
    checkpoint_name,
    checkpoint_step,
    old_dir,
    temp_dir,
    write_latest,
)
from zeroshard.ckpt._stfile import check_header_fits, fsync_dir, write_file
from zeroshard.comm import Agreement, Group, warn_on_rank0

_pending: SaveHandle | None = None


class SaveHandle:
    """A save in progress or done; `wait()` (on every rank) finishes and commits it."""

    def __init__(
        self,
        agreement: Agreement,
        root: Path,
        name: str,
        meta: CheckpointMeta,
    ) -> None:
        self._agreement = agreement
        self._root = root
        self._name = name
        self._meta = meta
        self._thread: threading.Thread | None = None
        self._file: FileMeta | None = None
        self._error: BaseException | None = None
        self._committed = False
        self._failure: BaseException | None = None
        self._file_metadata: dict[str, str] | None = None

    @property
    def path(self) -> Path:
        """The checkpoint directory once committed."""
        return self._root / self._name

    @property
    def done(self) -> bool:
        """True once the checkpoint is committed (and `latest` names it)."""
        return self._committed

    def _write(self, tensors: Mapping[str, torch.Tensor], ready: torch.cuda.Event | None) -> None:
        try:
            if ready is not None:
                ready.synchronize()
            tmp = temp_dir(self._root, self._name)
            path = tmp / rank_file(self._agreement.rank)
            try:
                self._file = write_file(path, tensors, self._file_metadata)
                fsync_dir(tmp)
            except OSError as e:  # disk full, file too large, I/O error
                raise CheckpointError(
                    f"save of {self._name!r}: writing {path} failed ({e.strerror or e}); "
                    "the previous checkpoints are untouched"
                ) from e
        except BaseException as e:  # re-raised on the main thread by wait()
            self._error = e

    def _start(self, tensors: Mapping[str, torch.Tensor], async_save: bool) -> None:
        if not async_save:
            self._write(tensors, None)
            return
        snapshot, ready = _snapshot(tensors)
        self._thread = threading.Thread(
            target=self._write, args=(snapshot, ready), name=f"zeroshard-save-{self._name}"
        )
        self._thread.daemon = True
        self._thread.start()

    def wait(self) -> Path:
        """Finish writing and commit (collective: call on every rank); return the directory."""
        global _pending
        if self._committed:
            return self.path
        if self._failure is not None:  # the ranks already agreed it failed: no collective
            raise self._failure
        if _pending is self:
            _pending = None
        try:
            return self._finish()
        except BaseException as e:
            self._failure = e
            raise

    def _finish(self) -> Path:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        ag = self._agreement
        f = self._file
        error = self._error
        if error is None and f is None:
            error = CheckpointError(f"rank {ag.rank} wrote no file")
        try:  # every rank raises the same error ([Note: one outcome] in zeroshard.comm)
            ag.outcome(error, f"save of {self._name!r}: writing the shards", CHECKPOINT_ERRORS)
        except CheckpointError:
            if ag.rank == 0:
                shutil.rmtree(temp_dir(self._root, self._name), ignore_errors=True)
            raise
        size, crc = (0, 0) if f is None else (f.size, int(f.digest, 16))
        rows = ag.gather([size, crc], f"save {self._name}: files written")
        problem: BaseException | None = None
        if ag.rank == 0:
            files = {rank_file(r): FileMeta(row[0], f"{row[1]:08x}") for r, row in enumerate(rows)}
            try:
                meta = self._meta.with_files(self._meta.step, files, self._meta.buffer_shapes)
                _publish(self._root, self._name, meta)
            except BaseException as e:
                problem = e
        ag.outcome(problem, f"save of {self._name!r}: commit", CHECKPOINT_ERRORS)
        self._committed = True
        return self.path


@atexit.register
def _commit_pending_at_exit() -> None:
    """Commit a pending async save before the interpreter exits, or fail the exit loudly."""
    if _pending is None:
        return
    name = _pending._name
    try:
        _pending.wait()
    except BaseException as e:
        print(
            f"zeroshard: async save {name!r} could not be committed at exit ({e}); the "
            "checkpoint was NOT saved: call handle.wait() on every rank before "
            "destroy_process_group()",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)  # an exception in an atexit hook would not change the exit status


def _snapshot(
    tensors: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], torch.cuda.Event | None]:
    """Host copies that later in-place updates cannot touch; an event when CUDA copies run."""
    out: dict[str, torch.Tensor] = {}
    cuda = False
    for key, t in tensors.items():
        t = t.detach()
        if t.device.type == "cuda":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            # Issued on the current stream, after the kernels that produced `t` and
            # before any later update of it, so the snapshot is of this step.
            host.copy_(t, non_blocking=True)
            cuda = True
        elif t.device.type == "cpu":
            host = t.clone(memory_format=torch.contiguous_format)
        else:
            host = t.to("cpu", copy=True)
        out[key] = host
    ready = None
    if cuda:
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record()
    return out, ready


def _check_tensors(
    meta: CheckpointMeta, tensors: Mapping[str, torch.Tensor], rank: int, size: int
) -> dict[str, torch.Tensor]:
    """This rank's file contents in a fixed order; CheckpointError naming what is wrong."""
    if meta.world_size != size:
        raise CheckpointError(
            f"metadata is for world size {meta.world_size} but the group has {size} ranks"
        )
    out: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    for key, (dtype, numel) in expected_shard_keys(meta, rank).items():
        t = tensors.get(key)
        if t is None:
            problems.append(f"missing shard {key!r}")
        elif t.dtype != dtype or t.dim() != 1 or t.numel() != numel:
            problems.append(
                f"shard {key!r} is {t.dtype} {tuple(t.shape)}, metadata says {dtype} ({numel},)"
            )
        else:
            out[key] = t
    for key, (dtype, shape) in param_state_keys(meta, rank).items():
        t = tensors.get(key)
        if t is None:
            problems.append(f"missing param state {key!r}")
        elif t.dtype != dtype or tuple(t.shape) != shape:
            problems.append(
                f"param state {key!r} is {t.dtype} {tuple(t.shape)}, metadata says {dtype} {shape}"
            )
        else:
            out[key] = t
    buffer_keys = {buffer_key(b) for b in meta.buffers}
    if rank == 0:
        for b in meta.buffers:
            t = tensors.get(buffer_key(b))
            if t is None:
                problems.append(f"missing buffer {b!r} (key {buffer_key(b)!r})")
            else:
                out[buffer_key(b)] = t
    extra = sorted(set(tensors) - set(out) - buffer_keys)
    if extra:
        problems.append(f"tensors not described by the metadata: {extra[:10]}")
    if problems:
        raise CheckpointError(f"rank {rank}: cannot save: " + "; ".join(problems))
    return out


def _prepare(root: Path, name: str, overwrite: bool) -> None:
    """Rank 0: refuse an existing checkpoint (unless overwrite); make an empty temp dir."""
    if not overwrite and ((root / name).exists() or old_dir(root, name).exists()):
        raise OutputExistsError(f"checkpoint {root / name} exists; pass overwrite=True")
    root.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(root, name)
    # Temp dirs left by killed saves are garbage by construction (never renamed), and so
    # are checkpoints a killed `remove_checkpoint` had moved aside. The previous save of
    # this process is committed by now, so no temp dir here is in use: one job writes
    # to a root at a time.
    for doomed in [*root.glob(".*.tmp"), *root.glob(".*.del-*")]:
        shutil.rmtree(doomed, ignore_errors=True)
    for stale in root.glob(f".{LATEST}.tmp-*"):  # a pointer update that was killed
        stale.unlink(missing_ok=True)
    tmp.mkdir()
    fsync_dir(root)


def _publish(root: Path, name: str, meta: CheckpointMeta) -> None:
    """Rank 0: metadata, rename into place, `latest` last (see [Note: commit protocol])."""
    tmp = temp_dir(root, name)
    with open(tmp / METADATA, "w") as f:
        f.write(meta.to_json())
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    final, old = root / name, old_dir(root, name)
    if final.exists():
        # Overwrite: move the old one aside first (a directory cannot be renamed onto a
        # non-empty one); `resolve` falls back to the moved copy if we die in between.
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(root)
    write_latest(root, name)
    shutil.rmtree(old, ignore_errors=True)


def save(
    root: str | os.PathLike[str],
    step: int,
    *,
    meta: CheckpointMeta,
    tensors: Mapping[str, torch.Tensor],
    group: Group | None = None,
    tag: str | None = None,
    async_save: bool = False,
    overwrite: bool = False,
    extra: RankExtra | None = None,
) -> SaveHandle:
    """Save this rank's shards (call on every rank) as `root/step-{step}` (or `root/{tag}`).

    `tensors` maps `shard_key(group, kind)` to this rank's 1-D shard for every group and
    kind in `meta`, plus `buffer_key(name)` for each buffer on rank 0, and
    `param_state_key(param, state)` for each whole-parameter state `meta.param_states`
    puts in this rank's file. `group` None means
    the default process group if one is initialized, else a single process. Returns a
    handle; with `async_save` the write runs in the background and `wait()` commits.
    `extra` is this rank's own state, stored in its file (see [Note: extra state in the
    rank file]).
    """
    global _pending
    if _pending is not None:
        _commit_previous(_pending)
    ag = Agreement(group)
    root = Path(root)
    name = _agreed_name(ag, root, step, tag, async_save, overwrite)
    shapes = {}
    if ag.rank == 0:  # rank 0 holds the buffers and writes the metadata
        shapes = {
            b: tuple(tensors[k].shape) for b in meta.buffers if (k := buffer_key(b)) in tensors
        }
    meta = meta.with_files(checkpoint_step(step), {}, shapes)
    file_metadata = None if extra is None else {"format": "pt", EXTRA_METADATA: extra.text}
    problem: BaseException | None = None
    ordered: dict[str, torch.Tensor] = {}
    try:
        ordered = _check_tensors(meta, tensors, ag.rank, ag.size)
        if extra is not None:
            ordered.update(extra_entries(extra, ordered))
        check_header_fits(ordered, file_metadata, f"rank {ag.rank}'s file")
        if ag.rank == 0:
            _prepare(root, name, overwrite)
    except (CheckpointError, OSError) as e:
        problem = e
    try:
        ag.outcome(problem, f"save of {name!r}: before writing", CHECKPOINT_ERRORS)
    except CheckpointError:
        if ag.rank == 0:
            shutil.rmtree(temp_dir(root, name), ignore_errors=True)
        raise
    handle = SaveHandle(ag, root, name, meta)
    handle._file_metadata = file_metadata
    handle._start(ordered, async_save)
    if async_save:
        _pending = handle
    else:
        handle.wait()
    return handle


def _commit_previous(previous: SaveHandle) -> None:
    """Commit the pending async save before the next one starts. If it failed, every
    rank learnt so in the same agreement: it is reported, and the next save goes on
    (a failed write must not cost the checkpoint after it too)."""
    try:
        previous.wait()
    except CheckpointError as e:
        warn_on_rank0(
            f"the async save {previous._name!r} failed and was not committed ({e}); "
            "the next save goes on"
        )


def _agreed_name(
    ag: Agreement,
    root: Path,
    step: object,
    tag: str | None,
    async_save: bool,
    overwrite: bool,
) -> str:
    """The checkpoint's name, once every rank passed the same, valid arguments: the
    same ValueError on every rank where they differ (see [Note: the same value on
    every rank] in zeroshard.comm), the same CheckpointError where they are invalid."""
    try:
        name = checkpoint_name(checkpoint_step(step), tag)
        problem = None
    except CheckpointError as e:
        name, problem = "", e
    fields = [
        ("root", os.path.abspath(root)),
        ("checkpoint", name or f"(invalid: {problem})"),
        ("async_save", str(bool(async_save))),
        ("overwrite", str(bool(overwrite))),
    ]
    hint = "Call save with the same arguments on every rank"
    ag.check_same(fields, "at save", f"save to {root}: arguments", hint)
    if problem is not None:
        raise problem
    return name
