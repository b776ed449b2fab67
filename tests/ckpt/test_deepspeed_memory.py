"""Reading a DeepSpeed checkpoint keeps memory bounded: nothing is loaded until read, and
reads go around the memory map, so the mapped file pages never join our resident set.

The checkpoint here is synthetic (plain torch.save of DeepSpeed's ZeRO-3 layout: the
same keys, an int where DeepSpeed pickles its stage enum) so that it can be big (two
128 MiB partitions plus Adam moments) without DeepSpeed.
"""

from __future__ import annotations

import math
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from zeroshard.ckpt import read_deepspeed_checkpoint

MIB = 1 << 20


def _rss_file_kib() -> int:
    """Resident file-backed pages of this process (what touching a memory map adds)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    raise AssertionError("no RssFile in /proc/self/status")


def _write_zero3(
    root: Path, shapes: dict[str, tuple[int, ...]], world: int
) -> dict[str, torch.Tensor]:
    """A ZeRO-3 checkpoint of `shapes` at `world` ranks; returns the full tensors."""
    tag = root / "global_step1"
    tag.mkdir(parents=True)
    (root / "latest").write_text("global_step1")
    gen = torch.Generator().manual_seed(0)
    full = {n: torch.randn(math.prod(s), generator=gen) for n, s in shapes.items()}
    parts: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for t in full.values():
        part = math.ceil(t.numel() / world)
        padded = torch.cat([t, torch.zeros(part * world - t.numel())])
        for r in range(world):
            parts[r].append(padded[r * part : (r + 1) * part])
    for r in range(world):
        flat = torch.cat(parts[r])
        optim = {
            "zero_stage": 3,
            "partition_count": world,
            "fp32_flat_groups": [flat],
            "optimizer_state_dict": {"state": {0: {"exp_avg": flat.clone(), "exp_avg_sq": flat}}},
        }
        torch.save(
            {"optimizer_state_dict": optim}, tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        )
        model = {
            "module": OrderedDict(),
            "buffer_names": [],
            "param_shapes": [OrderedDict((n, torch.Size(s)) for n, s in shapes.items())],
            "shared_params": {},
            "dp_world_size": world,
        }
        torch.save(model, tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
    return {n: t.view(shapes[n]) for n, t in full.items()}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_reading_does_not_grow_the_resident_set(tmp_path: Path) -> None:
    shapes = {f"layer{i}.weight": (1024, 4096 + i) for i in range(16)}  # 256 MiB in fp32
    shapes["bias"] = (1023,)
    full = _write_zero3(tmp_path, shapes, world=2)
    ckpt = read_deepspeed_checkpoint(tmp_path)
    specs = {s.name: s for s in ckpt.specs}
    out = torch.empty(max(s.numel for s in ckpt.specs))

    specs["bias"].read(out[:1023])  # first read: loads whatever code pages it needs
    before = _rss_file_kib()
    total = 0
    for name, spec in specs.items():
        view = out[: spec.numel]
        spec.read(view)
        assert torch.equal(view.view(spec.shape), full[name]), name
        total += spec.numel * 4
    grown = (_rss_file_kib() - before) * 1024
    assert total > 250 * MIB
    # Copying out of the map would add every byte read; allow a little for code pages.
    assert grown < 16 * MIB, f"resident file pages grew by {grown / MIB:.0f} MiB"
