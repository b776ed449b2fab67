"""A small, plain Llama-style model: the second model the benchmarks time, next to `gpt.py`.

Token embedding, pre-RMSNorm blocks (causal grouped-query attention through
`F.scaled_dot_product_attention` with rotary position embeddings on q and k, then a
SwiGLU MLP), a final RMSNorm and an untied output head; no biases. `Llama(idx)` returns
logits and `Llama(idx, targets)` the mean cross-entropy, as `gpt.GPT` does.

`LlamaConfig.preset(name)` gives the named sizes; `parameters_count` and `flops_per_token`
give the figures an MFU is computed from (the convention of `gpt.flops_per_token`).
The same shapes build `transformers.LlamaForCausalLM` (see `hf_config`), whose parameter
count is the same.
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
class LlamaConfig:
    """The shape of a Llama; `preset(name, **overrides)` gives the named sizes."""

    vocab_size: int = 256
    d_model: int = 256
    n_layer: int = 4
    n_head: int = 4
    # Grouped-query attention: every n_head // n_kv_head query heads share one k/v head.
    n_kv_head: int = 2
    ffn_hidden: int = 688  # SwiGLU width (Llama: about 8/3 d_model, rounded up)
    seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # Recompute each block's activations in backward (as gpt.GPTConfig's flag).
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layer", "n_head", "n_kv_head", "ffn_hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise ValueError(f"LlamaConfig.seq_len must be a positive int, got {self.seq_len!r}")
        if self.d_model % self.n_head or (self.d_model // self.n_head) % 2:
            raise ValueError(
                f"LlamaConfig.d_model ({self.d_model}) must split into n_head ({self.n_head}) "
                "heads of an even width (rotary embeddings rotate pairs)"
            )
        if self.n_head % self.n_kv_head:
            raise ValueError(
                f"LlamaConfig.n_head ({self.n_head}) must be a multiple of n_kv_head "
                f"({self.n_kv_head})"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_head

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LlamaConfig:
        """The preset `name` (see `PRESETS`), with any field replaced by `overrides`."""
        if name not in PRESETS:
            raise ValueError(f"unknown Llama preset {name!r}; valid: {', '.join(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)


# "1.3b": TinyLlama's width (d 2048, 4 k/v heads, SwiGLU 5632) with 24 layers, 1.21B
# parameters; "7b": Llama-3-8B's block (d 4096, 8 k/v heads, SwiGLU 14336), 32 layers and
# Llama-2's 32000-token vocabulary, 7.24B parameters.
PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(),
    "1.3b": LlamaConfig(
        vocab_size=32000,
        d_model=2048,
        n_layer=24,
        n_head=16,
        n_kv_head=4,
        ffn_hidden=5632,
        seq_len=2048,
    ),
    "7b": LlamaConfig(
        vocab_size=32000,
        d_model=4096,
        n_layer=32,
        n_head=32,
        n_kv_head=8,
        ffn_hidden=14336,
        seq_len=2048,
        rope_theta=500000.0,
    ),
}


def rotary_tables(cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (seq_len, head_dim), in the half-split layout of HF's Llama."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(half, dtype=torch.float32) / half)
    angles = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin over the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """Causal grouped-query attention: separate q, k, v projections, rotary q and k."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        kv = cfg.n_kv_head * cfg.head_dim
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k = nn.Linear(cfg.d_model, kv, bias=False)
        self.v = nn.Linear(cfg.d_model, kv, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """(batch, seq, d_model) -> (batch, seq, d_model); cos/sin are (seq, head_dim)."""
        b, t, _ = x.shape
        # The heads this rank computes: all of them, or its part under tensor parallelism
        # (q, k and v split by heads, benchmarks/train_step's zs3tp).
        q = self.q(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(b, t, -1))
        return out


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.proj = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d_model) -> (..., d_model)."""
        out: torch.Tensor = self.proj(F.silu(self.gate(x)) * self.up(x))
        return out


class Block(nn.Module):
    """Pre-RMSNorm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """(batch, seq, d_model) -> (batch, seq, d_model)."""
        x = x + self.attn(self.attn_norm(x), cos, sin)
        out: torch.Tensor = x + self.mlp(self.mlp_norm(x))
        return out


class Llama(nn.Module):
    """The whole model; `blocks` is an `nn.ModuleList` so wrappers can shard per block."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg)
        # Not in the state dict: derived from the config, like HF's rotary tables.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """N(0, 0.02) weights, residual projections scaled by 1/sqrt(2 n_layer), norms one."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.RMSNorm):
                module.reset_parameters()
            elif isinstance(module, nn.Linear | nn.Embedding):
                std = residual_std if name.endswith("proj") else 0.02
                module.weight.normal_(0.0, std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab) for token ids `idx`; the mean cross-entropy if `targets`."""
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than seq_len={self.cfg.seq_len}")
        x = self.tok_emb(idx)
        # The tables follow the compute dtype of the activations (bf16 under a cast model).
        cos, sin = self.rope_cos[:t].to(x.dtype), self.rope_sin[:t].to(x.dtype)
        recompute = self.cfg.activation_checkpointing and torch.is_grad_enabled()
        for block in self.blocks:
            # The block itself is called inside the checkpoint so that module hooks (where
            # sharded engines gather parameters) fire on the recompute too.
            if recompute:
                x = torch.utils.checkpoint.checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        logits: torch.Tensor = self.head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def parameters_count(cfg: LlamaConfig, *, embeddings: bool = True) -> int:
    """Parameters of `Llama(cfg)`; without the token embedding if not `embeddings` (the
    untied head is a matmul, so it is always counted)."""
    d, kv = cfg.d_model, cfg.n_kv_head * cfg.head_dim
    per_block = 2 * d * d + 2 * d * kv + 3 * d * cfg.ffn_hidden + 2 * d
    body = cfg.n_layer * per_block + d + cfg.vocab_size * d  # + final norm + head
    return body + cfg.vocab_size * d if embeddings else body


def flops_per_token(cfg: LlamaConfig) -> int:
    """Training FLOPs per token: 6 N + 12 n_layer d_model seq_len (see gpt.flops_per_token).

    N is every parameter but the token embedding (a lookup), the untied head included.
    """
    return (
        6 * parameters_count(cfg, embeddings=False) + 12 * cfg.n_layer * cfg.d_model * cfg.seq_len
    )


def hf_config(cfg: LlamaConfig) -> dict[str, Any]:
    """Keyword arguments of `transformers.LlamaConfig` for the same shapes (SDPA attention,
    untied head, no biases)."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "max_position_embeddings": cfg.seq_len,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    }
