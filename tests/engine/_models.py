"""Small models and a plain single-process reference trainer for parity tests."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

VOCAB = 37


class Block(nn.Module):
    """A residual MLP block with odd sizes."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class OddModel(nn.Module):
    """Odd sizes (none divisible by 2, 3 or 4), a tied embedding/head, a frozen layer,
    a bare nn.Parameter, a buffer, and two blocks in a ModuleList (stage 3 units),
    optionally under activation checkpointing."""

    def __init__(self, d: int = 13, hidden: int = 29, checkpoint: bool = False) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.emb = nn.Embedding(VOCAB, d)
        self.l1 = nn.Linear(d, hidden)
        self.frozen = nn.Linear(hidden, hidden)
        self.frozen.requires_grad_(False)
        self.l2 = nn.Linear(hidden, d)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.blocks = nn.ModuleList([Block(d, hidden + 2 * i) for i in range(2)])
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("offset", torch.arange(d, dtype=torch.float32) / d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.offset.to(self.emb.weight.dtype)
        h = F.gelu(self.l1(x))
        h = torch.tanh(self.frozen(h))
        x = x + self.l2(h) * self.scale
        for block in self.blocks:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(x)


def make_model(seed: int = 0, checkpoint: bool = False) -> OddModel:
    """The same model on every rank for a given seed."""
    torch.manual_seed(seed)
    return OddModel(checkpoint=checkpoint)


def make_optimizer(model: nn.Module, kind: str = "adamw") -> torch.optim.Optimizer:
    """Two param groups (no decay on biases/vectors), as real training scripts do."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), foreach=True)


def parity_atol(name: str, want: torch.Tensor) -> float:
    """The absolute tolerance of parameter `name`, trained by `muon_and_adamw`, against a
    single-process reference that sums the same gradients in another order (shards,
    replicas, tp). Muon's matrices (2-D but the embedding): torch's Muon orthogonalizes in
    bf16, so a gradient whose last fp32 bits differ may round to another bf16 value, and
    Newton-Schulz spreads that over the matrix (on an AVX-512 host: 2.1e-4 at lr 0.02,
    1.3e-3 on a matrix joined from its tp pieces; a wrong piece or owner is off by the
    update itself, ~4e-3 an element a step). AdamW's: an element whose gradient sums to
    nearly zero moves by a good part of its lr whatever the gradient's size (a few 1e-6
    apart, seen there)."""
    return 2e-3 if want.dim() == 2 and not name.startswith("emb.") else 1e-5


def muon_and_adamw(
    model: nn.Module, muon: type[torch.optim.Optimizer] | None = None
) -> list[torch.optim.Optimizer]:
    """torch's recipe: Muon on the hidden matrices (2-D weights but the tied embedding),
    AdamW on the rest; `muon` another class of Muon's signature."""
    emb = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    params = [p for p in model.parameters() if p.requires_grad]
    hidden = [p for p in params if p.dim() == 2 and id(p) not in emb]
    rest = [p for p in params if p.dim() != 2 or id(p) in emb]
    cls = muon or torch.optim.Muon
    return [
        cls(hidden, lr=0.02, momentum=0.95, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW(rest, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, foreach=True),
    ]


def global_batches(steps: int, accum: int, world: int, micro: int, seq: int = 7) -> torch.Tensor:
    """[steps, accum, world, micro, seq+1] token ids, identical on every rank."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB, (steps, accum, world, micro, seq + 1), generator=g)


def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, computed in fp32."""
    logits = model(tokens[..., :-1])
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[..., 1:].reshape(-1))


def reference_run(
    model: nn.Module,
    make_opt: Callable[[nn.Module], torch.optim.Optimizer | list[torch.optim.Optimizer]],
    batches: torch.Tensor,
    clip: float | None,
) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Train a copy of `model` in one process on the global batch: losses, norms, state
    dict. `make_opt` may give several optimizers (over disjoint parameters)."""
    ref = copy.deepcopy(model)
    made = make_opt(ref)
    opts = made if isinstance(made, list) else [made]
    losses, norms = [], []
    for step in batches:
        flat = step.reshape(-1, step.shape[-1])  # the whole global batch at once
        loss = loss_fn(ref, flat)
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)))
        for opt in opts:
            opt.step()
            opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms, {k: v.detach().clone() for k, v in ref.state_dict().items()}
