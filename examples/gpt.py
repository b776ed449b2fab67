"""A small, plain GPT: the model that the demo trains and the benchmarks time.

Token and position embeddings, pre-LayerNorm blocks (causal self-attention through
`F.scaled_dot_product_attention`, then a GELU MLP), a final LayerNorm and an output head
whose weight is the token embedding's (tied). `GPT(idx)` returns logits and
`GPT(idx, targets)` the mean cross-entropy, so a training loop needs nothing else.

`GPTConfig.preset(name)` gives the named sizes; `parameters_count` and `flops_per_token`
give the figures an MFU is computed from (see `flops_per_token` for the convention).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """The shape of a GPT; `preset(name, **overrides)` gives the named sizes."""

    vocab_size: int = 256
    d_model: int = 256
    n_layer: int = 4
    n_head: int = 4
    seq_len: int = 128
    mlp_ratio: int = 4
    bias: bool = True
    # Recompute each block's activations in backward (non-reentrant torch.utils.checkpoint):
    # only the blocks' inputs stay alive between forward and backward.
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layer", "n_head", "seq_len", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_head

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """The preset `name` (see `PRESETS`), with any field replaced by `overrides`."""
        if name not in PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}; valid: {', '.join(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)


# "tiny" is the demo (byte-level vocabulary, ~3.3M parameters); "1.3b" is the
# GPT-3 XL shape the benchmarks time; "7b" is the LLaMA-7B width and depth in GPT form;
# "wide" is 7b's width at 8 layers and seq 4096 (1.83B), where fp8 matmuls pay most.
# 50304 = 50257 (GPT-2's vocabulary) rounded up to a multiple of 64 for tensor cores.
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=256, d_model=256, n_layer=4, n_head=4, seq_len=128),
    "1.3b": GPTConfig(vocab_size=50304, d_model=2048, n_layer=24, n_head=16, seq_len=2048),
    "7b": GPTConfig(vocab_size=50304, d_model=4096, n_layer=32, n_head=32, seq_len=2048),
    "wide": GPTConfig(vocab_size=50304, d_model=4096, n_layer=8, n_head=32, seq_len=4096),
}


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused q/k/v projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, d_model) -> (batch, seq, d_model)."""
        b, t, d = x.shape
        # (b, t, 3, heads, head_dim) -> three (b, heads, t, head_dim)
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(b, t, d))
        return out


class MLP(nn.Module):
    """Linear -> GELU (tanh approximation, as GPT-2) -> Linear."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d_model) -> (..., d_model)."""
        out: torch.Tensor = self.proj(F.gelu(self.fc(x), approximate="tanh"))
        return out


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, d_model) -> (batch, seq, d_model)."""
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    """The whole model; `blocks` is an `nn.ModuleList` so wrappers can shard per block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # Tied: one Parameter seen under two names; `parameters()` yields it once.
        self.head.weight = self.tok_emb.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 initialization: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer)."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()  # weight one, bias zero
            elif isinstance(module, nn.Linear | nn.Embedding):
                # The residual projections add into the stream 2 n_layer times.
                std = residual_std if name.endswith("proj") else 0.02
                module.weight.normal_(0.0, std)
                bias = getattr(module, "bias", None)
                if bias is not None:
                    bias.zero_()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab) for token ids `idx`; the mean cross-entropy if `targets`."""
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than seq_len={self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        recompute = self.cfg.activation_checkpointing and torch.is_grad_enabled()
        for block in self.blocks:
            # Calling the block itself (not its forward) inside the checkpoint keeps module
            # hooks firing on the recompute too, which sharded engines gather parameters in.
            x = _recomputed(block, x) if recompute else block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _recomputed(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`block(x)`, its activations recomputed in backward instead of kept."""
    out: torch.Tensor = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    return out


def parameters_count(cfg: GPTConfig, *, embeddings: bool = True) -> int:
    """Parameters of `GPT(cfg)`, the tied embedding counted once; without both embeddings if not."""
    d, f = cfg.d_model, cfg.mlp_ratio * cfg.d_model
    b = 1 if cfg.bias else 0
    attn = d * 3 * d + b * 3 * d + d * d + b * d
    mlp = d * f + b * f + f * d + b * d
    norms = 2 * (d + b * d)
    per_block = attn + mlp + norms
    body = cfg.n_layer * per_block + (d + b * d)  # + final LayerNorm
    if not embeddings:
        return body
    return body + cfg.vocab_size * d + cfg.seq_len * d


def flops_per_token(cfg: GPTConfig) -> int:
    """Training FLOPs per token (forward + backward): 6 N + 12 n_layer d_model seq_len.

    N is every parameter except the embeddings, plus the output head (the tied token
    embedding, counted once as the head's matmul; the lookups are free). Norms and biases
    are in N although they are not matmuls: under 0.5% of it at every preset. The attention
    term is PaLM's (appendix B): QK^T and AV over the full sequence, not halved for the
    causal mask, so MFU figures compare with those usually published.
    """
    n_matmul = parameters_count(cfg, embeddings=False) + cfg.vocab_size * cfg.d_model
    return 6 * n_matmul + 12 * cfg.n_layer * cfg.d_model * cfg.seq_len
