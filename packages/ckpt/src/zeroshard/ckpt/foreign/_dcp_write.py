"""`convert_to_dcp`: a zeroshard checkpoint rewritten as a PyTorch DCP checkpoint, which an
FSDP2 job restores with `dcp.load` and `set_state_dict` at any world size.

[Note: writing DCP]
The output holds what `dcp.save({"model": m, "optimizer": o, "step": n})` writes for
`m, o = get_state_dict(model, optimizer)`: `model.<name>` (the masters, buffers; a tied
name points at its canonical one's bytes), `optimizer.state.<name>.<key>` (Adam's
moments, and `step` as the 0-dim float32 tensor torch keeps), the hyperparameters and
`params` of each param group under `optimizer.param_groups.<i>.<key>`, and `step`. In
torchtitan's layout the model's names stand at the top level, each parameter carries its
group's hyperparameters (`optimizer.param_groups.<name>.<key>`, as
`flatten_optimizer_state_dict` gives them) and the step is `train_state.step`.
Each tensor is cut into chunks of whole rows of at most `CHUNK_ELEMENTS` elements, each
chunk one `torch.save` archive in a `.distcp` file ([Note: DCP on disk] in
`_dcp_pickle`). Workers write one file each, reading every chunk straight from the rank
files (`RangeSpec.read_range`): a worker holds one chunk and its archive, never a whole
tensor. DCP's reader takes any chunking (it copies each saved chunk's overlap with the
shard a rank asks for). The `.metadata`, torch's own record classes pickled, is written
last, and the directory is renamed into place only once complete.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import shutil
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast, get_args

import torch

from zeroshard.ckpt._errors import CheckpointError, OutputExistsError
from zeroshard.ckpt._keys import OPTIM_PREFIX
from zeroshard.ckpt._paths import check_output_apart
from zeroshard.ckpt._reader import CheckpointReader
from zeroshard.ckpt._source import checkpoint_specs, slot_spec
from zeroshard.ckpt._stfile import fsync_dir
from zeroshard.ckpt._writer import RangeSpec, default_workers
from zeroshard.ckpt.foreign._dcp import DCP_METADATA

# Elements per chunk (16 MiB of fp32): what a worker holds at once, twice (tensor, archive).
CHUNK_ELEMENTS = 4 * 2**20


Key = tuple[str | int, ...]  # a path in the nested state dict; DCP's name joins it with "."
DcpLayout = Literal["fsdp2", "torchtitan"]
DCP_LAYOUTS: tuple[DcpLayout, ...] = get_args(DcpLayout)


@dataclass(frozen=True)
class _Tensor:
    """One tensor to write, at its path in the nested state dict."""

    path: Key
    spec: RangeSpec

    @property
    def fqn(self) -> str:
        """Its name in the checkpoint, as `dcp.save` flattens the path."""
        return _fqn(self.path)


def _fqn(path: Key) -> str:
    return ".".join(map(str, path))


@dataclass(frozen=True)
class _Written:
    """Where one chunk (offsets in the tensor) or value went: file, byte offset, length."""

    fqn: str
    offsets: tuple[int, ...] | None
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int


def _constant(name: str, value: float) -> RangeSpec:
    """A 0-dim float32 tensor holding `value` (Adam's step, as torch keeps it)."""

    def read_range(start: int, out: torch.Tensor) -> None:
        out.fill_(value)

    def read(out: torch.Tensor) -> None:
        out.fill_(value)

    return RangeSpec(name, (), torch.float32, read, read_range)


def _hyperparameter(value: Any) -> Any:
    # JSON stored torch's tuples (Adam's betas) as lists.
    return tuple(value) if isinstance(value, list) else value


def _contents(
    reader: CheckpointReader, layout: DcpLayout
) -> tuple[list[_Tensor], dict[Key, str], dict[Key, Any]]:
    """The tensors (model, optimizer state), tied names {alias's path: canonical name} and
    values {path: value} of the output, laid out as FSDP2's `get_state_dict` saved under
    `model` and `optimizer`, or as torchtitan saves it (the model at the top level, the
    optimizer flattened: `flatten_optimizer_state_dict`)."""
    meta = reader.meta
    if meta.param_states:
        raise CheckpointError(
            f"{reader.path}: optimizer state kept whole per parameter (a whole-matrix optimizer "
            "such as Muon) has no FSDP2 form here: only per-element state (Adam's) is written"
        )
    several = sorted(g.name for g in meta.groups if g.instances > 1 and g.tensor_split is None)
    if several:
        raise CheckpointError(
            f"{reader.path}: groups {several} hold several instances (parameters on a process "
            "group of their own, e.g. experts): one FSDP2 model has one value per name"
        )
    titan = layout == "torchtitan"

    def model(name: str) -> Key:
        return (name,) if titan else ("model", name)

    def state(name: str, key: str) -> Key:
        return ("optimizer", f"state.{name}.{key}") if titan else ("optimizer", "state", name, key)

    specs, aliases = checkpoint_specs(reader)
    # A zeroshard checkpoint's specs all read ranges (`_source`).
    tensors = [_Tensor(model(s.name), cast(RangeSpec, s)) for s in specs]
    tied = {model(a): _fqn(model(c)) for a, c in aliases.items()}
    values: dict[Key, Any] = {}
    if titan:
        # torchtitan's TrainState: zeroshard counts no tokens.
        values.update({("train_state", "step"): meta.step, ("train_state", "ntokens_seen"): 0})
    else:
        values[("step",)] = meta.step
    params: dict[int, list[str]] = {}
    for g in meta.groups:
        if not g.requires_grad or g.param_group is None:
            continue
        params.setdefault(g.param_group, []).extend(s.name for s in g.layout.slots)
        for slot in g.layout.slots:
            kept = {
                kind[len(OPTIM_PREFIX) :]: slot_spec(reader, g, slot, kind)
                for kind in g.shards
                if kind.startswith(OPTIM_PREFIX)
            }
            kept.update({k: _constant(slot.name, float(v)) for k, v in g.scalars.items()})
            tensors += [_Tensor(state(slot.name, key), spec) for key, spec in kept.items()]
    for i, names in sorted(params.items()):
        if i >= len(meta.param_groups):
            raise CheckpointError(f"{reader.path}: param group {i} has no saved hyperparameters")
        hyper = {k: _hyperparameter(v) for k, v in meta.param_groups[i].items()}
        if titan:  # each parameter's own copy, keyed by its name
            for name in names:
                values.update(
                    {("optimizer", f"param_groups.{name}.{k}"): v for k, v in hyper.items()}
                )
        else:
            for key, value in {**hyper, "params": names}.items():
                values[("optimizer", "param_groups", i, key)] = value
    return tensors, tied, values


def _chunks(shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of whole-row chunks of at most CHUNK_ELEMENTS (one row at least)."""
    if not shape or math.prod(shape) == 0:
        return [((0,) * len(shape), shape)]
    row = math.prod(shape[1:])
    rows = max(1, CHUNK_ELEMENTS // max(row, 1))
    rest = (0,) * (len(shape) - 1)
    return [((r, *rest), (min(rows, shape[0] - r), *shape[1:])) for r in range(0, shape[0], rows)]


def _archive(obj: Any) -> memoryview:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getbuffer()


def _write_file(
    path: Path, tensors: Sequence[_Tensor], values: Mapping[Key, Any]
) -> list[_Written]:
    """One `.distcp` file: `values` then every chunk of `tensors`; fsynced."""
    out: list[_Written] = []
    with open(path, "wb") as f:
        for key, value in values.items():
            data = _archive(value)
            out.append(_Written(_fqn(key), None, (), path.name, f.tell(), len(data)))
            f.write(data)
        for t in tensors:
            row = math.prod(t.spec.shape[1:]) if t.spec.shape else 1
            for offsets, sizes in _chunks(t.spec.shape):
                chunk = torch.empty(sizes, dtype=t.spec.dtype)
                if chunk.numel():
                    first = offsets[0] * row if offsets else 0
                    t.spec.read_range(first, chunk.view(-1))
                data = _archive(chunk)
                out.append(_Written(t.fqn, offsets, sizes, path.name, f.tell(), len(data)))
                f.write(data)
                del chunk, data
        f.flush()
        os.fsync(f.fileno())
    return out


def _metadata(
    tensors: Sequence[_Tensor],
    tied: Mapping[Key, str],
    values: Mapping[Key, Any],
    written: Sequence[_Written],
    dst: Path,
) -> Any:
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    by_fqn: dict[str, list[_Written]] = {}
    for w in written:
        by_fqn.setdefault(w.fqn, []).append(w)
    entries: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, Key] = {}  # name -> path, as DCP's default planner records it
    names = {t.fqn: t for t in tensors}
    for path, t in [*((t.path, t) for t in tensors), *((a, names[c]) for a, c in tied.items())]:
        fqn = _fqn(path)
        chunks = by_fqn[t.fqn]
        entries[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=t.spec.dtype),
            torch.Size(t.spec.shape),
            [
                ChunkStorageMetadata(torch.Size(w.offsets or ()), torch.Size(w.sizes))
                for w in chunks
            ],
        )
        for w in chunks:
            storage[MetadataIndex(fqn, torch.Size(w.offsets or ()))] = _StorageInfo(
                w.file, w.offset, w.length
            )
        planner[fqn] = path
    for path in values:
        fqn = _fqn(path)
        entries[fqn] = BytesStorageMetadata()
        (w,) = by_fqn[fqn]
        storage[MetadataIndex(fqn)] = _StorageInfo(w.file, w.offset, w.length)
        planner[fqn] = path
    return Metadata(
        state_dict_metadata=entries,
        planner_data=planner,
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=str(dst), save_id=str(uuid.uuid4())),
        version=CURRENT_DCP_VERSION,
    )


def convert_to_dcp(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    tag: str | None = None,
    step: int | None = None,
    layout: Literal["fsdp2", "torchtitan"] = "fsdp2",
    workers: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Write zeroshard checkpoint `src` (a checkpoint, or a root and `tag` / `step`) as the
    PyTorch DCP checkpoint directory `dst`; return `dst`.

    `layout="fsdp2"`: as `dcp.save({"model": m, "optimizer": o, "step": n})` of
    `get_state_dict`'s dicts, which an FSDP2 job at any world size `dcp.load`s into its own
    and applies with `set_state_dict`. `"torchtitan"`: the model at the top level, the
    optimizer flattened (`flatten_optimizer_state_dict`), `train_state` (step; tokens 0).
    """
    if layout not in DCP_LAYOUTS:
        raise ValueError(f"layout must be one of {DCP_LAYOUTS}, got {layout!r}")
    check_output_apart(src, dst)
    out = Path(dst)
    if out.exists() and not overwrite:
        raise OutputExistsError(f"{out} exists; pass overwrite=True (--overwrite) to replace it")
    reader = CheckpointReader(src, tag=tag, step=step)
    reader.check_present()
    reader.verify()
    tensors, tied, values = _contents(reader, layout)
    n = max(1, min(workers or default_workers(), len(tensors)))
    # Biggest tensors first, each to the least loaded file: the files end about even.
    files: list[list[_Tensor]] = [[] for _ in range(n)]
    load = [0] * n
    for t in sorted(tensors, key=lambda t: -t.spec.numel * t.spec.dtype.itemsize):
        i = load.index(min(load))
        files[i].append(t)
        load[i] += t.spec.numel * t.spec.dtype.itemsize
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        with ThreadPoolExecutor(n) as pool:
            jobs = [
                pool.submit(_write_file, tmp / f"__{i}_0.distcp", f, values if i == 0 else {})
                for i, f in enumerate(files)
            ]
            written = [w for job in jobs for w in job.result()]
        with open(tmp / DCP_METADATA, "wb") as f:
            pickle.dump(_metadata(tensors, tied, values, written, out), f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        if out.exists():
            out.rename(old)
        tmp.rename(out)
        fsync_dir(out.parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        reader.close()
    return out
