"""`consolidate`: a zeroshard, DeepSpeed ZeRO or PyTorch DCP checkpoint -> one safetensors
state dict.

Tied parameters are written once, under the canonical name (the one the model's
`named_parameters()` yields first; Hugging Face loaders expect the shared tensor once
and re-tie it); the aliases are listed in every file's `__metadata__` under
`zeroshard.tied` as JSON {alias: canonical}.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from zeroshard.ckpt._errors import CheckpointError, OutputExistsError
from zeroshard.ckpt._paths import METADATA, check_output_apart, is_zeroshard_checkpoint
from zeroshard.ckpt._reader import CheckpointReader
from zeroshard.ckpt._source import checkpoint_specs
from zeroshard.ckpt._spec import TensorSpec
from zeroshard.ckpt._writer import WriteResult, write_safetensors
from zeroshard.ckpt.foreign import (
    DeepSpeedCheckpoint,
    dcp_specs,
    has_dcp_metadata,
    is_deepspeed_checkpoint,
    read_deepspeed_checkpoint,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def deepspeed_checkpoint(
    src: Path, *, tag: str | None, step: int | None, exclude_frozen: bool
) -> DeepSpeedCheckpoint:
    """`src` read as a DeepSpeed ZeRO checkpoint (`step` selects `global_step{step}`), or a
    clear error saying it is neither format."""
    if src.is_dir() and not (src / METADATA).exists() and is_deepspeed_checkpoint(src):
        ds_tag = tag if step is None else f"global_step{step}"
        return read_deepspeed_checkpoint(src, ds_tag, exclude_frozen=exclude_frozen)
    raise CheckpointError(
        f"{src} is neither a zeroshard checkpoint (no {METADATA}, no 'latest' naming one) "
        "nor a DeepSpeed ZeRO checkpoint nor a PyTorch DCP checkpoint (no .metadata)"
    )


def source_specs(
    src: Path,
    *,
    tag: str | None,
    step: int | None,
    exclude_frozen: bool,
    verify_input: bool,
    instance: int | None = None,
) -> tuple[list[TensorSpec], dict[str, str], CheckpointReader | None]:
    """Specs and tied aliases of a zeroshard, DeepSpeed or DCP checkpoint (and our reader to
    close)."""
    if not src.exists():
        raise CheckpointError(f"{src} does not exist")
    if is_zeroshard_checkpoint(src, tag, step):
        reader = CheckpointReader(src, tag=tag, step=step)
        try:
            reader.check_present()
            if verify_input:
                reader.verify()
            specs, aliases = checkpoint_specs(
                reader, exclude_frozen=exclude_frozen, instance=instance
            )
        except BaseException:
            reader.close()
            raise
        return specs, aliases, reader
    if has_dcp_metadata(src):
        return dcp_specs(src), {}, None
    ds = deepspeed_checkpoint(src, tag=tag, step=step, exclude_frozen=exclude_frozen)
    return list(ds.specs), dict(ds.aliases), None


def consolidate(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    max_shard_size: int | None = None,
    workers: int | None = None,
    low_memory: bool = False,
    max_buffer_bytes: int | None = None,
    exclude_frozen: bool = False,
    tag: str | None = None,
    step: int | None = None,
    overwrite: bool = False,
    verify: bool = False,
    progress: bool = False,
    instance: int | None = None,
) -> WriteResult:
    """Write the full state dict of checkpoint `src` as safetensors at `out`.

    Every floating tensor is written in `dtype`, fp32 by default (frozen parameters and
    buffers included), as DeepSpeed's `zero_to_fp32` does; other tensors keep theirs.
    `out` ending in `.safetensors` is one file; otherwise a directory holding
    `model.safetensors`, or shards of at most `max_shard_size` bytes with
    `model.safetensors.index.json`. `instance` picks which instance of the groups on a
    process group of their own (experts) to write (required when they have several).
    See `write_safetensors` for the other options.
    """
    src, out = Path(src), Path(out)
    check_output_apart(src, out)
    if out.exists() and not overwrite:  # before reading a byte of the input
        raise OutputExistsError(f"{out} exists; pass --overwrite (overwrite=True) to replace it")
    specs, aliases, reader = source_specs(
        src,
        tag=tag,
        step=step,
        exclude_frozen=exclude_frozen,
        verify_input=True,
        instance=instance,
    )
    metadata = {"zeroshard.tied": json.dumps(aliases, sort_keys=True)} if aliases else {}
    try:
        return write_safetensors(
            specs,
            out,
            dtype=dtype,
            max_shard_size=max_shard_size,
            workers=workers,
            low_memory=low_memory,
            max_buffer_bytes=max_buffer_bytes,
            overwrite=overwrite,
            verify=verify,
            progress=progress,
            metadata=metadata,
        )
    finally:
        if reader is not None:
            reader.close()
