"""The model, optimizer and step both DCP switching tests train, FSDP2 and zeroshard alike
(tests/engine/test_dcp_resume.py, tests/engine/test_dcp_export.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

BATCHES, GLOBAL_BATCH, SEQ = 4, 6, 5  # global batches split evenly over 1, 2 or 3 ranks


class Net(nn.Module):
    """A tiny language model with a buffer; odd row counts shard unevenly."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.fc1 = nn.Linear(6, 5)  # 5 rows over 2 ranks: uneven shards
        self.norm = nn.LayerNorm(5)
        self.head = nn.Linear(5, 11)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.fc1(self.embed(tokens) * self.scale)))


def optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW with two param groups (weight decay on the matrices only)."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    rest = [
        p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)
    ]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=lr
    )


def train_step(model: nn.Module, opt: Any, batch: torch.Tensor) -> float:
    """One step on this rank's slice of the global batch; the mean loss over the ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per = batch.shape[0] // world
    tokens = batch[rank * per : (rank + 1) * per]
    logits = model(tokens)
    loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / world
