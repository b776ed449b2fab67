"""Models the `zeroshard-plan` command knows by name, built on the meta device.

The GPT presets have the shapes of `examples/gpt.py` (same modules, names and tied head;
`tests/engine/test_estimate_cli.py` checks they stay identical). `llama-70b` is the
published Llama-3-70B shape (grouped-query attention, SwiGLU, RMSNorm, untied head).
A path to a Hugging Face `config.json` builds that model through transformers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer's shape."""

    family: str  # 'gpt' or 'llama'
    vocab_size: int
    d_model: int
    n_layer: int
    n_head: int
    n_kv_head: int
    ffn: int
    seq_len: int

    @property
    def parameters(self) -> int:
        """Parameters of the `PresetModel` of this shape (a GPT's tied head counted once),
        without building it: the command's help lists every preset's."""
        d, ffn = self.d_model, self.ffn
        if self.family == "gpt":
            attention = 3 * d * d + 3 * d + d * d + d
            block = attention + (d * ffn + ffn) + (ffn * d + d) + 2 * 2 * d
            return self.vocab_size * d + self.seq_len * d + self.n_layer * block + 2 * d
        kv = 2 * self.n_kv_head * (d // self.n_head) * d
        block = d * d + kv + d * d + 3 * d * ffn + 2 * d
        return 2 * self.vocab_size * d + self.n_layer * block + d


PRESETS: dict[str, Shape] = {
    "tiny": Shape("gpt", 256, 256, 4, 4, 4, 1024, 128),
    "1.3b": Shape("gpt", 50304, 2048, 24, 16, 16, 8192, 2048),
    "7b": Shape("gpt", 50304, 4096, 32, 32, 32, 16384, 2048),
    "llama-70b": Shape("llama", 128256, 8192, 80, 64, 8, 28672, 8192),
}


class _Attention(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.n_head, self.n_kv = s.n_head, s.n_kv_head
        hd = s.d_model // s.n_head
        gpt = s.family == "gpt"
        if gpt:
            self.qkv = nn.Linear(s.d_model, 3 * s.d_model)
        else:
            self.q = nn.Linear(s.d_model, s.d_model, bias=False)
            self.kv = nn.Linear(s.d_model, 2 * s.n_kv_head * hd, bias=False)
        self.proj = nn.Linear(s.d_model, s.d_model, bias=gpt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        hd = d // self.n_head
        if hasattr(self, "qkv"):
            q, k, v = self.qkv(x).view(b, t, 3, self.n_head, hd).permute(2, 0, 3, 1, 4)
        else:
            q = self.q(x).view(b, t, self.n_head, hd).transpose(1, 2)
            k, v = self.kv(x).view(b, t, 2, self.n_kv, hd).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_head
        )
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(b, t, d))
        return out


class _MLP(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.gated = s.family == "llama"
        if self.gated:
            self.gate = nn.Linear(s.d_model, s.ffn, bias=False)
        self.fc = nn.Linear(s.d_model, s.ffn, bias=not self.gated)
        self.proj = nn.Linear(s.ffn, s.d_model, bias=not self.gated)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            h = F.silu(self.gate(x)) * self.fc(x)
        else:
            h = F.gelu(self.fc(x), approximate="tanh")
        out: torch.Tensor = self.proj(h)
        return out


def _norm(s: Shape) -> nn.Module:
    return nn.LayerNorm(s.d_model) if s.family == "gpt" else nn.RMSNorm(s.d_model)


class _Block(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = _norm(s), _Attention(s), _norm(s), _MLP(s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class PresetModel(nn.Module):
    """A decoder of `Shape`; `forward(idx)` returns the next-token loss."""

    def __init__(self, s: Shape, activation_checkpointing: bool) -> None:
        super().__init__()
        self.checkpointing = activation_checkpointing
        self.tok_emb = nn.Embedding(s.vocab_size, s.d_model)
        if s.family == "gpt":
            self.pos_emb = nn.Embedding(s.seq_len, s.d_model)
        self.blocks = nn.ModuleList(_Block(s) for _ in range(s.n_layer))
        self.ln_f = _norm(s)
        self.head = nn.Linear(s.d_model, s.vocab_size, bias=False)
        if s.family == "gpt":
            self.head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx)
        if hasattr(self, "pos_emb"):
            x = x + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            if self.checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), idx.flatten())


def build(name: str, *, activation_checkpointing: bool, n_layer: int | None = None) -> nn.Module:
    """The named preset (optionally with `n_layer` blocks), or the model of a Hugging Face
    config.json path, on the meta device."""
    if name in PRESETS:
        shape = PRESETS[name]
        if n_layer is not None:
            shape = dataclasses.replace(shape, n_layer=n_layer)
        with torch.device("meta"):
            return PresetModel(shape, activation_checkpointing)
    path = Path(name)
    if path.suffix != ".json":
        raise ValueError(
            f"unknown preset {name!r}; valid: {', '.join(PRESETS)}, or a path to a "
            "Hugging Face config.json"
        )
    if not path.is_file():
        raise ValueError(f"no such config file: {path}")
    try:
        import transformers
    except ImportError:
        raise ValueError(f"{path}: reading a Hugging Face config needs transformers") from None
    config = transformers.AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model: nn.Module = transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    if activation_checkpointing:
        # transformers 5 renamed gradient_checkpointing_enable (kept, deprecated).
        enable = getattr(model, "activation_checkpointing_enable", None)
        (enable or model.gradient_checkpointing_enable)()  # type: ignore[operator]
    return model


def convert_float8(model: nn.Module, recipe: str, all_gather: bool) -> None:
    """Every linear of `model` but its output head made torchao's fp8 training linear
    (as torchtitan converts), by `recipe` ('tensorwise', 'rowwise'), the weights gathered
    in fp8 with `all_gather` (tensorwise only)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ValueError("fp8 needs torchao: pip install 'torchao>=0.18'") from None
    if all_gather and recipe != "tensorwise":
        raise ValueError(f"the fp8 all-gather takes the tensorwise recipe, not {recipe!r}")
    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(recipe), enable_fsdp_float8_all_gather=all_gather
    )
    convert_to_float8_training(
        model,
        config=config,
        module_filter_fn=lambda m, fqn: fqn.rpartition(".")[2] not in ("head", "lm_head"),
    )
