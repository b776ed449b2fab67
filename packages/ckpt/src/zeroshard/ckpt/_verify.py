"""`--verify`: re-read a written output with the safetensors library and compare it.

The check is independent of our writer: the files are opened by `safetensors`, every
planned tensor must be there with its shape and dtype and nothing else, and every
tensor's bytes must equal a fresh read of its source, cast the same way.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open

from zeroshard.ckpt._errors import CheckpointError
from zeroshard.ckpt._plan import INDEX_FILE, OutputPlan, PlannedFile, output_dtype
from zeroshard.ckpt._spec import TensorSpec


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    )


def _check_batch(path: Path, specs: list[TensorSpec], dtype: torch.dtype | None) -> None:
    with safe_open(str(path), framework="pt") as f:
        for spec in specs:
            got = f.get_tensor(spec.name)
            want = torch.empty(spec.numel, dtype=spec.dtype)
            spec.read(want)
            want = want.to(output_dtype(spec, dtype)).reshape(spec.shape)
            if tuple(got.shape) != tuple(spec.shape) or not _same_bits(got, want):
                raise CheckpointError(
                    f"verify: {path.name}: tensor {spec.name!r} differs from its source "
                    f"(got {got.dtype} {tuple(got.shape)})"
                )


def _check_keys(f: PlannedFile, path: Path) -> None:
    with safe_open(str(path), framework="pt") as st:
        keys = set(st.keys())
    want = {s.name for s in f.specs}
    if keys != want:
        raise CheckpointError(
            f"verify: {path.name} holds {sorted(keys ^ want)[:10]} unexpectedly or not at all"
        )


def verify_output(plan: OutputPlan, where: Path, dtype: torch.dtype | None, workers: int) -> None:
    """Raise CheckpointError naming the first tensor, file or index entry that differs."""
    jobs: list[tuple[Path, list[TensorSpec]]] = []
    for f in plan.files:
        path = where / f.name
        _check_keys(f, path)
        per = max(1, -(-len(f.specs) // max(1, workers)))
        jobs += [(path, list(f.specs[i : i + per])) for i in range(0, len(f.specs), per)]
    if plan.index is not None:
        index = json.loads((where / INDEX_FILE).read_text())
        if index != json.loads(json.dumps(plan.index)):
            raise CheckpointError(f"verify: {INDEX_FILE} differs from the planned index")
    with ThreadPoolExecutor(max(1, workers)) as pool:
        for fut in [pool.submit(_check_batch, p, s, dtype) for p, s in jobs]:
            fut.result()
