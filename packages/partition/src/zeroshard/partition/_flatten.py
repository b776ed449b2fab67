"""Flattening parameters into one padded buffer, in three memory tiers.

[Note: flattening tiers]
Packing N parameters into a flat buffer naively needs the originals plus a full copy
on the device at once. That is fine while it fits (`DEVICE`). When it does not, the
`DISTRIBUTED` tier has every rank copy only its own shard range, drop the originals,
then all-gather the shards into the full buffer: the peak is max(originals + shard,
full + shard), never originals + full. The `CPU` tier packs on the host, drops the
device originals and moves the packed buffer over: the device peak is max(originals,
full), at the price of two host transfers. In every tier each parameter's `.data`
ends up a view of the buffer, so the old storage is freed once nothing else holds it.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Sequence

import torch

from zeroshard.comm import Group, is_rank0, process_rank
from zeroshard.partition._host import empty_host
from zeroshard.partition._layout import FlatLayout

logger = logging.getLogger("zeroshard.partition")


class FlattenTier(enum.Enum):
    """Where the full flat buffer is assembled (see [Note: flattening tiers])."""

    AUTO = "auto"
    DEVICE = "device"
    DISTRIBUTED = "distributed"
    CPU = "cpu"


def _check(params: Sequence[torch.Tensor], layout: FlatLayout) -> None:
    """ValueError naming the first parameter that does not fit its slot."""
    if len(params) != len(layout.slots):
        raise ValueError(f"got {len(params)} parameters for a layout of {len(layout.slots)} slots")
    owner: dict[int, str] = {}
    for p, s in zip(params, layout.slots, strict=True):
        if p.dtype != layout.dtype:
            raise ValueError(
                f"parameter {s.name!r} has dtype {p.dtype}, the layout holds {layout.dtype}"
            )
        if tuple(p.shape) != s.shape:
            raise ValueError(
                f"parameter {s.name!r} has shape {tuple(p.shape)}, its slot has {s.shape}"
            )
        if not p.is_contiguous():
            raise ValueError(f"parameter {s.name!r} is not contiguous")
        if p.numel() == 0 or p.device.type == "meta":
            continue
        # Two params on one storage would alias once re-pointed; tied weights must be
        # deduplicated (group_parameters) before flattening.
        key = p.untyped_storage().data_ptr()
        if key in owner:
            raise ValueError(f"parameters {owner[key]!r} and {s.name!r} share storage")
        owner[key] = s.name


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    # CUDA's fused copy of 16-bit floats goes through float32 and quiets NaN payloads;
    # copying the same bits as integers keeps every parameter bitwise unchanged.
    return t.view(_BITS[t.element_size()]) if t.is_floating_point() else t


def _copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """Copy srcs into dsts bit for bit: one fused kernel for same-device pairs."""
    if not dsts:
        return
    if all(d.dtype == s.dtype for d, s in zip(dsts, srcs, strict=True)):
        dsts, srcs = [_as_bits(d) for d in dsts], [_as_bits(s) for s in srcs]
    same = [i for i, (d, s) in enumerate(zip(dsts, srcs, strict=True)) if d.device == s.device]
    if len(same) == len(dsts):
        torch._foreach_copy_(dsts, srcs)
        return
    if same:
        torch._foreach_copy_([dsts[i] for i in same], [srcs[i] for i in same])
    done = set(same)
    for i, (d, s) in enumerate(zip(dsts, srcs, strict=True)):
        if i not in done:
            d.copy_(s)


@torch.no_grad()
def _pack_range(
    params: Sequence[torch.Tensor], layout: FlatLayout, lo: int, hi: int, out: torch.Tensor
) -> None:
    """Write elements [lo, hi) of the padded flat buffer into `out`; padding becomes zeros."""
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    gaps: list[torch.Tensor] = []
    cursor = lo
    for p, s in zip(params, layout.slots, strict=True):
        if s.offset >= hi:
            break
        a, b = max(s.offset, lo), min(s.end, hi)
        if a >= b:
            continue
        if a > cursor:
            gaps.append(out[cursor - lo : a - lo])
        dsts.append(out[a - lo : b - lo])
        srcs.append(p.detach().reshape(-1)[a - s.offset : b - s.offset])
        cursor = b
    if cursor < hi:
        gaps.append(out[cursor - lo : hi - lo])
    if gaps:
        torch._foreach_zero_(gaps)
    _copy(dsts, srcs)


def _repoint(params: Sequence[torch.Tensor], layout: FlatLayout, flat: torch.Tensor) -> None:
    """Make every param's `.data` its view of `flat` (autograd never sees the swap)."""
    for p, view in zip(params, unflatten(flat, layout).values(), strict=True):
        p.data = view


def _drop(params: Sequence[torch.Tensor]) -> None:
    """Release the params' storage: each `.data` becomes an empty tensor of its dtype/device."""
    for p in params:
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def _device_fits(nbytes: int, device: torch.device) -> bool:
    """True when `device` has room for `nbytes` more (free memory plus the cache's slack)."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    slack = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return bool(free + slack >= nbytes)


def _choose(layout: FlatLayout, device: torch.device, group: Group | None) -> FlattenTier:
    """The AUTO decision; with a group of several ranks every rank agrees on it."""
    nbytes = layout.padded_numel * layout.dtype.itemsize
    fits = _device_fits(nbytes, device)
    if group is None or group.size == 1:
        return FlattenTier.DEVICE if fits else FlattenTier.CPU
    if device.type != "cpu":
        # One rank short of memory sends everyone down a tier: the DISTRIBUTED tier is a
        # collective, so a split decision would hang the ranks that chose it.
        flag = torch.tensor([0.0 if fits else 1.0], device=group.device)
        group.all_reduce(flag, op="max", label="flatten tier").wait()
        fits = flag.item() == 0.0
    return FlattenTier.DEVICE if fits else FlattenTier.DISTRIBUTED


def _flatten_device(
    params: Sequence[torch.Tensor], layout: FlatLayout, device: torch.device
) -> torch.Tensor:
    flat = torch.empty(layout.padded_numel, dtype=layout.dtype, device=device)
    _pack_range(params, layout, 0, layout.padded_numel, flat)
    return flat


def _flatten_distributed(
    params: Sequence[torch.Tensor], layout: FlatLayout, device: torch.device, group: Group
) -> torch.Tensor:
    if layout.padded_numel % group.size:
        raise ValueError(
            f"distributed flatten: padded_numel {layout.padded_numel} does not split evenly "
            f"over a group of {group.size} ranks"
        )
    n = layout.padded_numel // group.size
    lo = group.rank * n
    shard = torch.empty(n, dtype=layout.dtype, device=device)
    _pack_range(params, layout, lo, lo + n, shard)
    # The originals go before the full buffer is allocated: that is the whole point of
    # this tier. Other ranks hold the parts this rank drops (params are replicated).
    _drop(params)
    flat = torch.empty(layout.padded_numel, dtype=layout.dtype, device=device)
    group.all_gather_into(flat, shard, label="distributed flatten").wait()
    return flat


def _flatten_cpu(
    params: Sequence[torch.Tensor], layout: FlatLayout, device: torch.device
) -> torch.Tensor:
    host, pinned = empty_host(layout.padded_numel, layout.dtype, pin=device.type == "cuda")
    if device.type == "cuda" and not pinned:
        logger.info(
            "CPU flatten tier: pinning failed on rank %s; packing in pageable memory",
            process_rank(),
        )
    _pack_range(params, layout, 0, layout.padded_numel, host)
    if device.type == "cpu":
        return host
    # Device originals are freed before the device copy is allocated: device peak is
    # max(originals, full), not their sum.
    _drop(params)
    return host.to(device)


def flatten_params(
    params: Sequence[torch.Tensor],
    layout: FlatLayout,
    *,
    device: torch.device,
    tier: FlattenTier = FlattenTier.AUTO,
    group: Group | None = None,
) -> tuple[torch.Tensor, FlattenTier]:
    """Pack `params` into one padded flat buffer on `device`; each param's `.data` becomes its view.

    Returns the buffer and the tier used. AUTO (a collective when `group` has several
    ranks on an accelerator) picks DEVICE if a full copy fits, else DISTRIBUTED with a
    group, else CPU. DISTRIBUTED needs `group` and params equal on every rank.
    """
    _check(params, layout)
    device = torch.device(device)
    if not isinstance(tier, FlattenTier):
        raise ValueError(f"tier must be a FlattenTier, got {tier!r}")
    if tier is FlattenTier.AUTO:
        tier = _choose(layout, device, group)
    start = time.perf_counter()
    if tier is FlattenTier.DEVICE:
        flat = _flatten_device(params, layout, device)
    elif tier is FlattenTier.DISTRIBUTED:
        if group is None:
            raise ValueError("the DISTRIBUTED flatten tier needs a process group (group=...)")
        flat = _flatten_distributed(params, layout, device, group)
    else:
        flat = _flatten_cpu(params, layout, device)
    _repoint(params, layout, flat)
    # Every rank flattens the same layouts: rank 0 speaks for them.
    if logger.isEnabledFor(logging.INFO) and is_rank0():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        logger.info(
            "flattened %d params (%.1f MiB %s) on %s, tier %s, in %.3f s",
            len(params),
            flat.numel() * flat.element_size() / 2**20,
            layout.dtype,
            device,
            tier.value,
            time.perf_counter() - start,
        )
    return flat, tier


def flatten_shard(
    params: Sequence[torch.Tensor], layout: FlatLayout, rank: int, *, device: torch.device
) -> torch.Tensor:
    """Rank `rank`'s shard of the flat buffer (shard_numel elements, zero padding).

    The params are left untouched: this is what ZeRO-3 keeps of them.
    """
    _check(params, layout)
    lo, hi = layout.shard_range(rank)
    shard = torch.empty(hi - lo, dtype=layout.dtype, device=torch.device(device))
    _pack_range(params, layout, lo, hi, shard)
    return shard


def unflatten(flat: torch.Tensor, layout: FlatLayout) -> dict[str, torch.Tensor]:
    """Views of `flat` (a full padded buffer) shaped like each slot, by slot name."""
    if flat.dim() != 1 or flat.numel() != layout.padded_numel:
        raise ValueError(
            f"unflatten: expected a 1-D buffer of {layout.padded_numel} elements, "
            f"got shape {tuple(flat.shape)}"
        )
    if flat.dtype != layout.dtype:
        raise ValueError(f"unflatten: buffer dtype {flat.dtype} != layout dtype {layout.dtype}")
    return {s.name: flat[s.offset : s.end].view(s.shape) for s in layout.slots}
