"""The layer benchmarks/leaf_fetch fetches: 64 experts under a root that routes tokens."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn


class Expert(nn.Module):
    """d -> 4d -> d with bias."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The expert's MLP."""
        out: torch.Tensor = self.down(F.gelu(self.up(x)))
        return out


class MoELayer(nn.Module):
    """The experts; tokens come routed (top-1 expert index per token)."""

    def __init__(self, d: int, experts: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList([Expert(d) for _ in range(experts)])

    def forward(self, x: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
        """Each token through its chosen expert."""
        out = torch.zeros_like(x)
        for e in torch.unique(choice).tolist():
            mask = choice == e
            out[mask] = self.experts[e](x[mask])
        return out


class Router(nn.Module):
    """The root: a top-1 router and the MoE layer (the router keeps the root a unit)."""

    def __init__(self, d: int, experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d, experts, bias=False)
        self.moe = MoELayer(d, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route each token to its top expert."""
        out: torch.Tensor = self.moe(x, self.gate(x).argmax(-1))
        return out


def build(args: argparse.Namespace, device: torch.device) -> Router:
    """The same layer on every rank and every call (fixed seed)."""
    torch.manual_seed(0)
    with torch.device(device):
        return Router(args.d, args.experts)
