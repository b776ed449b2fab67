"""Compare zeroshard's safetensors output with the peer tool's, tensor by tensor, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def _safe_open(path: Path) -> Any:
    from safetensors import safe_open

    return safe_open(str(path), framework="pt")


def compare_outputs(ours: Path, theirs: Path, peer: str) -> tuple[int, str]:
    """Compare our safetensors output with the `peer` tool's (.bin or .safetensors files),
    tensor by tensor, tied names included; (tensors checked, the first problem or "")."""
    mine: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    handles = []  # open while their tensors are compared
    for f in sorted(ours.glob("*.safetensors")):
        h = _safe_open(f)
        handles.append(h)
        tied.update(json.loads((h.metadata() or {}).get("zeroshard.tied", "{}")))
        for k in h.keys():  # noqa: SIM118 (safe_open is not a mapping)
            mine[k] = h.get_tensor(k)
    checked = 0
    for f in sorted(theirs.iterdir()):
        part: dict[str, torch.Tensor]
        if f.suffix == ".bin":
            part = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
        elif f.suffix == ".safetensors":
            h = _safe_open(f)
            part = {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118
        else:
            continue
        for name, want in part.items():
            got = mine.get(tied.get(name, name))
            if got is None:
                return checked, f"{name} missing from zeroshard's output"
            if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
                return checked, f"{name} differs"
            checked += 1
    expected = len(mine) + len(tied)
    if checked != expected:
        return checked, f"{peer} wrote {checked} tensors, zeroshard {expected} (with tied)"
    return checked, ""
