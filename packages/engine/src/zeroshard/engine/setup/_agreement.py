"""`check_ranks_agree`: every rank must initialize the same model with the same config;
`raise_if_any_failed`: a step of initialize that failed on one rank fails it on every rank.

[Note: the initialize digest]
Ranks that disagree (stage 2 on one, 3 on another; fp32 against bf16; one extra layer)
would issue different collectives, and gloo aborts the process or a rank reads past the
end of its unit list. So `initialize` first describes, as a list of (field, value)
strings, what must be equal on every rank: every config field, the world size, and
every parameter's name, shape, dtype, requires_grad and optimizer param group. One
all-gather of two integers (a hash of the list, its length) settles the common case.
Only when they differ do two more all-gathers find the first differing field and
bring every rank's value of it, so each rank raises the same `ValueError` naming the
field and which ranks hold which value.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from zeroshard.comm import Group

_VALUE_BYTES = 512
_ABSENT = "(absent)"


def describe_rank(
    config: Any, world: Group, model: nn.Module, optimizer: torch.optim.Optimizer
) -> list[tuple[str, str]]:
    """What must be equal on every rank, as (field, value) strings in a fixed order."""
    fields = list(_config_fields("config", config))
    fields.append(("world size", str(world.size)))
    group_of = {id(p): k for k, pg in enumerate(optimizer.param_groups) for p in pg["params"]}
    for i, (name, p) in enumerate(model.named_parameters()):
        value = (
            f"{name} {tuple(p.shape)} {p.dtype} requires_grad={p.requires_grad} "
            f"param_group={group_of.get(id(p))}"
        )
        fields.append((f"parameter {i}", value))
    return fields


def _config_fields(prefix: str, value: Any) -> list[tuple[str, str]]:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: list[tuple[str, str]] = []
        for f in dataclasses.fields(value):
            out += _config_fields(f"{prefix}.{f.name}", getattr(value, f.name))
        return out
    return [(prefix, repr(value))]


def _hash(text: str) -> int:
    # 7 bytes: a non-negative int64.
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


def _gather(world: Group, values: Sequence[int], label: str) -> list[list[int]]:
    send = torch.tensor(list(values), dtype=torch.int64, device=world.device)
    recv = torch.empty(len(values) * world.size, dtype=torch.int64, device=world.device)
    world.all_gather_into(recv, send, label=label).wait()
    return [[int(x) for x in row] for row in recv.view(world.size, len(values)).tolist()]


def check_ranks_agree(world: Group, fields: Sequence[tuple[str, str]]) -> None:
    """Raise the same ValueError on every rank if `fields` differ between ranks."""
    if world.size == 1:
        return
    hashes = [_hash(f"{k}={v}") for k, v in fields]
    total = _hash(",".join(map(str, hashes)))
    rows = _gather(world, [total, len(fields)], "initialize: ranks agree")
    if all(row == rows[0] for row in rows):
        return
    longest = max(row[1] for row in rows)
    padded = hashes + [0] * (longest - len(hashes))
    per_field = _gather(world, padded, "initialize: which field differs")
    first = next(i for i in range(longest) if len({row[i] for row in per_field}) > 1)
    key, value = fields[first] if first < len(fields) else (_ABSENT, _ABSENT)
    text = f"{key}\0{value}".encode()[:_VALUE_BYTES]
    row = [len(text), *text, *([0] * (_VALUE_BYTES - len(text)))]
    texts = _gather(world, row, "initialize: the differing values")
    seen: dict[str, list[int]] = {}
    for rank, got in enumerate(texts):
        k, _, v = bytes(got[1 : 1 + got[0]]).decode(errors="replace").partition("\0")
        seen.setdefault(f"{k} = {v}" if k != _ABSENT else _ABSENT, []).append(rank)
    names = sorted({k.split(" = ")[0] for k in seen if k != _ABSENT})
    holders = "; ".join(f"rank(s) {ranks}: {what}" for what, ranks in seen.items())
    raise ValueError(
        f"ranks disagree at initialize on {' / '.join(names) or key}: {holders}. Every rank "
        "must build the same model and pass the same config"
    )


def raise_if_any_failed(world: Group, what: str, error: str) -> None:
    """Raise the same RuntimeError on every rank if any rank's `error` is set ("" where
    its `what` succeeded), naming the failing ranks and the first one's error."""
    if world.size == 1:
        failed = [0] if error else []
    else:
        flags = _gather(world, [int(bool(error))], f"initialize: {what}")
        failed = [rank for rank, (bad,) in enumerate(flags) if bad]
    if not failed:
        return
    text = error.encode()[:_VALUE_BYTES]
    row = [len(text), *text, *([0] * (_VALUE_BYTES - len(text)))]
    if world.size > 1:
        row = _gather(world, row, f"initialize: {what}, the error")[failed[0]]
    first = bytes(row[1 : 1 + row[0]]).decode(errors="replace")
    raise RuntimeError(f"{what} failed on rank(s) {failed}; rank {failed[0]}: {first}")
