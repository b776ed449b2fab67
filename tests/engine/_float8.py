"""A small model with torchao fp8 linears, and torch DDP + torchao as its reference.

torchao's dynamic scales are per rank (each rank scales its own activations), so a single
process on the global batch is not the reference here: torch DDP on the same ranks, fed
the same micro-batches, is.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB = 37
D, HIDDEN = 32, 64  # multiples of 16: fp8 matmuls need them on the GPU


class Block(nn.Module):
    """A residual MLP block: its two linears are the ones converted to fp8."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, HIDDEN)
        self.down = nn.Linear(HIDDEN, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    """Embedding, two blocks (stage-3 units), an unconverted head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def float8_config(recipe: str, gather: bool, device: str) -> Any:
    """torchao's config for `recipe`, emulated on the CPU, gathering in fp8 if `gather`."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(
        config, emulate=device == "cpu", enable_fsdp_float8_all_gather=gather
    )


def make_net(seed: int, recipe: str | None, gather: bool, device: str) -> Net:
    """The same `Net` on every rank for `seed`, its blocks converted to fp8 (`recipe`)."""
    from torchao.float8 import convert_to_float8_training

    torch.manual_seed(seed)
    net = Net().to(device)
    if recipe is not None:
        convert_to_float8_training(
            net,
            config=float8_config(recipe, gather, device),
            module_filter_fn=lambda m, fqn: fqn.startswith("blocks"),
        )
    return net


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW over every trainable parameter."""
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-2, betas=(0.9, 0.95)
    )


def batches(steps: int, accum: int, world: int, micro: int = 2, seq: int = 8) -> torch.Tensor:
    """[steps, accum, world, micro, seq+1] token ids, identical on every rank (16 tokens a
    micro-batch: the real fp8 matmuls want every inner dimension a multiple of 16)."""
    g = torch.Generator().manual_seed(99)
    return torch.randint(0, VOCAB, (steps, accum, world, micro, seq + 1), generator=g)


def loss_of(model: Callable[[torch.Tensor], torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy in fp32."""
    logits = model(tokens[..., :-1])
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[..., 1:].reshape(-1))


def train(
    model: Callable[[torch.Tensor], torch.Tensor],
    opt: torch.optim.Optimizer,
    data: torch.Tensor,
    clip: float | None,
    clip_fn: Callable[[float], torch.Tensor],
    device: str,
) -> list[float]:
    """Train on this rank's micro-batches of `data`; the global mean loss of each step."""
    world, rank = dist.get_world_size(), dist.get_rank()
    losses = []
    for step in data:
        total = torch.zeros(1, device=device)
        for micro in step:
            loss = loss_of(model, micro[rank].to(device)) / len(step)
            loss.backward()
            total += loss.detach()
        if clip is not None:
            clip_fn(clip)
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def ddp_reference(
    net: Net, data: torch.Tensor, clip: float | None, device: str
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """torch DDP with torchao (a copy of `net`) on these ranks: losses and final weights."""
    ref = copy.deepcopy(net)
    ddp = nn.parallel.DistributedDataParallel(ref)
    opt = make_optimizer(ref)

    def clip_fn(max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)

    losses = train(ddp, opt, data, clip, clip_fn, device)
    return losses, {k: v.detach().cpu().clone() for k, v in ref.state_dict().items()}
