"""Deterministic per-rank test data: any rank can rebuild every other rank's tensors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zeroshard.comm import Group

# Integer values in [-8, 8]: sums over <= 4 ranks are exact in bf16, so only averages round.
LOW, HIGH = -8, 9


def rank_data(rank: int, seed: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank `rank`'s CPU tensor for case `seed`: a pure function of (rank, seed, numel, dtype)."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    return torch.randint(LOW, HIGH, (numel,), generator=g).to(dtype)


def rank_device() -> torch.device:
    """The device of this rank's tensors: its GPU under NCCL, else CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_reference(values: list[torch.Tensor], op: str) -> torch.Tensor:
    """sum / avg / max over ranks, computed in float64 on CPU."""
    stacked = torch.stack([v.double().cpu() for v in values])
    if op == "sum":
        return stacked.sum(0)
    if op == "avg":
        return stacked.sum(0) / len(values)
    if op == "max":
        return stacked.max(0).values
    raise ValueError(f"unknown op {op!r}")


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """`actual` (in `dtype`) equals the float64 `expected` rounded to `dtype`, within one ulp."""
    assert actual.dtype == dtype, (actual.dtype, dtype)
    exp = expected.to(dtype)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(actual.cpu(), exp, rtol=8e-3, atol=1e-2)
    else:
        torch.testing.assert_close(actual.cpu(), exp, rtol=1e-6, atol=1e-6)


def ranks_for(device: str) -> int:
    """World size of a test: 4 CPU ranks, or up to 4 GPUs (one rank per GPU)."""
    if device == "cpu":
        return 4
    gpus = torch.cuda.device_count()
    if gpus == 0:
        pytest.skip("no CUDA device")
    return min(4, gpus)


def groups_by_size() -> dict[int, Group | None]:
    """A Group of every size 1..world (ranks 0..k-1; the world group for k = world).

    Collective on every rank; a rank outside the size-k group gets None for k.
    """
    world, me = dist.get_world_size(), dist.get_rank()
    out: dict[int, Group | None] = {world: Group()}
    for k in range(1, world):
        pg = dist.new_group(list(range(k)))
        out[k] = Group(pg) if me < k else None
    return out
