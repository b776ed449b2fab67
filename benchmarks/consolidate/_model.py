"""The GPT both checkpoint sources hold: GPT-2 style, the head tied to the embedding."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """A pre-norm GPT-2 block."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = max(1, d // 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attention then MLP, each on the normed input, added to the residual."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, -1).unbind(2)
        a = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))
        return out


class GPT(nn.Module):
    """GPT-2 style: token and position embeddings, blocks, final norm, (tied) head."""

    def __init__(self, vocab: int, d: int, layers: int, tied: bool, ctx: int = 1024) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits for `tokens`."""
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits
