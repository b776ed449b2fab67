"""A small model with every kind of tensor a checkpoint holds, and its shards.

Tied embedding/head, a frozen layer, BatchNorm buffers (one int64), two optimizer
param groups, Adam state after a few real steps. `build(world_size, stage)` lays the
parameters and optimizer state out in flat buffers (by direct placement, not through
the code under test) and cuts each rank's shard.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from zeroshard.ckpt import CheckpointMeta, GroupMeta, buffer_key, shard_key
from zeroshard.partition import FlatLayout

ALIGN = 4


class TinyNet(nn.Module):
    def __init__(self, vocab: int = 37, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.block = nn.Sequential(nn.Linear(width, 16), nn.GELU(), nn.Linear(16, width))
        self.norm = nn.BatchNorm1d(width)
        self.frozen = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: state_dict() has both keys
        for p in self.frozen.parameters():
            p.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = self.norm(h + self.block(h)) + self.frozen(h)
        return self.head(h)


@dataclass
class Built:
    model: TinyNet
    meta: CheckpointMeta
    flats: dict[str, torch.Tensor]  # shard_key(group, kind) -> full padded flat buffer
    ranks: list[dict[str, torch.Tensor]]  # per rank: what save() takes
    optim_state: dict[str, dict[str, torch.Tensor]]  # param name -> exp_avg / exp_avg_sq


HYPER = (
    {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1},
    {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},
)


@functools.lru_cache(maxsize=4)
def trained_model(
    seed: int = 0, steps: int = 3
) -> tuple[TinyNet, list[list[str]], dict[str, dict[str, torch.Tensor]]]:
    """The model after `steps` Adam steps, its two param groups (names) and Adam state.

    Adam is written out here (torch.optim would import torch._dynamo: seconds per process).
    """
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = TinyNet()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        [n for n, _ in named if n.endswith("weight")],
        [n for n, _ in named if not n.endswith("weight")],
    ]
    params = dict(named)
    state = {
        n: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)} for n, p in named
    }
    for step in range(1, steps + 1):
        ids = torch.randint(0, 37, (6, 5), generator=g)
        loss = model(ids.view(-1)).float().pow(2).mean()
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for names, h in zip(groups, HYPER, strict=True):
                b1, b2 = h["betas"]
                for n in names:
                    p, st = params[n], state[n]
                    grad = p.grad + h["weight_decay"] * p
                    st["exp_avg"].mul_(b1).add_(grad, alpha=1 - b1)
                    st["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
                    denom = (st["exp_avg_sq"] / (1 - b2**step)).sqrt_().add_(h["eps"])
                    p.addcdiv_(st["exp_avg"], denom, value=-h["lr"] / (1 - b1**step))
    model.zero_grad(set_to_none=True)
    return model, groups, state


def _flat(layout: FlatLayout, values: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    flat = torch.zeros(layout.padded_numel, dtype=dtype)
    # Alignment gaps get a marker so that resharding is seen to keep them bit for bit.
    flat.fill_(-7.0 if dtype.is_floating_point else 0)
    flat[layout.numel :] = 0
    for s in layout.slots:
        flat[s.offset : s.end] = values[s.name].reshape(-1).to(dtype)
    return flat


def build(world_size: int, stage: int, seed: int = 0) -> Built:
    """The model, its checkpoint metadata and every rank's shards for a world size."""
    model, pgroups, state = trained_model(seed)
    named = dict(model.named_parameters())  # tied: the first name only
    groups: list[GroupMeta] = []
    flats: dict[str, torch.Tensor] = {}
    kinds = {
        "master": torch.float32,
        "optim.exp_avg": torch.float32,
        "optim.exp_avg_sq": torch.float32,
    }
    if stage in (1, 2):
        kinds["param"] = torch.bfloat16
    for gi, pnames in enumerate(pgroups):
        gname = f"g{gi}"
        params = {n: named[n].detach() for n in pnames}
        layout = FlatLayout.build(
            [(n, p.shape) for n, p in params.items()], torch.float32, world_size, ALIGN
        )
        groups.append(GroupMeta(gname, layout, kinds, gi, True, {"step": 3}))
        for kind, dtype in kinds.items():
            if kind.startswith("optim."):
                vals = {n: state[n][kind.removeprefix("optim.")] for n in params}
            else:
                vals = params
            flats[shard_key(gname, kind)] = _flat(layout, vals, dtype)
    frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    layout = FlatLayout.build(
        [(n, p.shape) for n, p in frozen.items()], torch.float32, world_size, ALIGN
    )
    groups.append(GroupMeta("frozen", layout, {"param": torch.float32}, None, False))
    flats[shard_key("frozen", "param")] = _flat(layout, frozen, torch.float32)
    buffers = dict(model.named_buffers())
    meta = CheckpointMeta(
        world_size=world_size,
        groups=tuple(groups),
        stage=stage,
        compute_dtype=torch.bfloat16,
        param_groups=HYPER,
        tied={"head.weight": "embed.weight"},
        buffers=tuple(buffers),
        extra={"seed": seed},
    )
    ranks: list[dict[str, torch.Tensor]] = []
    for r in range(world_size):
        mine: dict[str, torch.Tensor] = {}
        for g in groups:
            lo, hi = g.layout.shard_range(r)
            for kind in g.shards:
                key = shard_key(g.name, kind)
                mine[key] = flats[key][lo:hi].clone()
        if r == 0:
            mine.update({buffer_key(n): b.clone() for n, b in buffers.items()})
        ranks.append(mine)
    return Built(model, meta, flats, ranks, state)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (dtype, shape and bytes)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )
