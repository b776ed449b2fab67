"""The models benchmarks/train_step and benchmarks/lightning time (`--model`), each behind
one `BenchModel`, and the optimizer every engine steps them with (`adamw`).

- `gpt`: examples/gpt.py (LayerNorm, GELU MLP, learned positions, tied head);
- `llama`: examples/llama.py (RMSNorm, SwiGLU, rotary, grouped-query SDPA, untied head);
- `hf-llama`: `transformers.LlamaForCausalLM` built from the same shapes as `llama` (no
  download), behind `HFCausalLM` so that every engine sees `model(x, y) -> loss` and
  `model.blocks`.

Every engine gets a model from `BenchModel.build()`, built fresh on the current default
device, so all engines start from the same fp32 weights for one seed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from examples import gpt, llama

LR = 1e-4


def adamw(params: Any, device: torch.device) -> torch.optim.AdamW:
    """The optimizer of every engine: AdamW, fused on CUDA."""
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), fused=device.type == "cuda")


OPTIMIZERS = ("adamw", "muon")
MUON_LR = 0.02


def optimizers(
    params: list[Any], hidden: list[bool], device: torch.device, kind: str
) -> list[torch.optim.Optimizer]:
    """The engines' optimizers over `params`: AdamW on all (`adamw`), or torch's recipe
    (`muon`): torch.optim.Muon on the hidden matrices (`hidden`, as the planner's
    `hidden_matrices` says of a model's parameters), AdamW on the rest."""
    if kind == "adamw":
        return [adamw(params, device)]
    if kind != "muon":
        raise ValueError(f"unknown optimizer {kind!r}; valid: {', '.join(OPTIMIZERS)}")
    matrices = [p for p, h in zip(params, hidden, strict=True) if h]
    rest = [p for p, h in zip(params, hidden, strict=True) if not h]
    muon = torch.optim.Muon(matrices, lr=MUON_LR, adjust_lr_fn="match_rms_adamw")
    return [muon, adamw(rest, device)]


@dataclass(frozen=True)
class BenchModel:
    """One benchmarked model: how to build it, its size, its FLOPs and a one-line shape."""

    name: str
    preset: str
    build: Callable[[], nn.Module]
    tiny: Callable[[], nn.Module]  # a one-block model for untimed first set-ups
    parameters: int
    flops_per_token: int
    vocab_size: int
    seq_len: int
    shape: str  # for the report's first line
    config: dict[str, Any]


class HFCausalLM(nn.Module):
    """A `transformers` causal LM called like examples/gpt.py: `(idx, targets) -> loss`.

    The loss is computed here from the logits (HF's `labels` would shift them again), in
    fp32 as the other models do. `blocks` is the decoder's layer list, which the engines
    shard (FSDP2) or compile (floorc, fsdp2c) block by block.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    @property
    def blocks(self) -> nn.ModuleList:
        """The decoder layers, in order."""
        decoder: Any = self.model
        return cast(nn.ModuleList, decoder.model.layers)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for `idx`; the mean cross-entropy against `targets` if given."""
        logits: torch.Tensor = self.model(input_ids=idx, use_cache=False).logits
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _hf_llama(cfg: llama.LlamaConfig) -> nn.Module:
    transformers: Any = importlib.import_module("transformers")
    hf_cfg = transformers.LlamaConfig(**llama.hf_config(cfg), attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(hf_cfg)
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return HFCausalLM(model)


def _gpt_shape(g: gpt.GPTConfig) -> str:
    return (
        f"d {g.d_model}, {g.n_layer} layers, {g.n_head} heads, seq {g.seq_len}, "
        f"vocab {g.vocab_size}, LayerNorm, GELU MLP, tied head"
    )


def _llama_shape(source: str) -> Callable[[llama.LlamaConfig], str]:
    def shape(c: llama.LlamaConfig) -> str:
        return (
            f"{source}: d {c.d_model}, {c.n_layer} layers, {c.n_head} heads ({c.n_kv_head} "
            f"k/v), SwiGLU {c.ffn_hidden}, seq {c.seq_len}, vocab {c.vocab_size}, RMSNorm, "
            "rotary, SDPA, untied head"
        )

    return shape


@dataclass(frozen=True)
class _Family:
    """How to build one `--model` from its config class: presets, the smoke and tiny sizes,
    the module, its counts and its one-line shape."""

    config: Any  # the config class, with `preset(name, **overrides)`
    smoke: Any  # the config of `--smoke`
    tiny: Any  # the config of the untimed first set-ups
    make: Callable[[Any], nn.Module]
    parameters_count: Callable[[Any], int]
    flops_per_token: Callable[[Any], int]
    shape: Callable[[Any], str]


_SMOKE_LLAMA = llama.LlamaConfig(
    vocab_size=512, d_model=128, n_layer=2, n_head=4, n_kv_head=2, ffn_hidden=344, seq_len=64
)
# Heads and widths that 2 tensor-parallel ranks split (zs3tp's untimed first set-up).
_TINY_LLAMA = llama.LlamaConfig(
    vocab_size=64, d_model=32, n_layer=1, n_head=4, n_kv_head=2, ffn_hidden=64, seq_len=8
)
FAMILIES: dict[str, _Family] = {
    "gpt": _Family(
        gpt.GPTConfig,
        gpt.GPTConfig(vocab_size=512, d_model=128, n_layer=2, n_head=4, seq_len=64),
        gpt.GPTConfig(vocab_size=64, d_model=32, n_layer=1, n_head=1, seq_len=8),
        gpt.GPT,
        gpt.parameters_count,
        gpt.flops_per_token,
        _gpt_shape,
    ),
    "llama": _Family(
        llama.LlamaConfig,
        _SMOKE_LLAMA,
        _TINY_LLAMA,
        llama.Llama,
        llama.parameters_count,
        llama.flops_per_token,
        _llama_shape("examples/llama.py"),
    ),
    "hf-llama": _Family(
        llama.LlamaConfig,
        _SMOKE_LLAMA,
        _TINY_LLAMA,
        _hf_llama,
        llama.parameters_count,
        llama.flops_per_token,
        _llama_shape("transformers.LlamaForCausalLM"),
    ),
}
MODELS = tuple(FAMILIES)


def bench_model(
    name: str, preset: str, *, smoke: bool, seq_len: int | None, activation_checkpointing: bool
) -> BenchModel:
    """The model `name` at `preset` (a tiny one under `smoke`), with optional overrides."""
    family = FAMILIES.get(name)
    if family is None:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(MODELS)}")
    overrides: dict[str, Any] = {"activation_checkpointing": activation_checkpointing}
    if seq_len:
        overrides["seq_len"] = seq_len
    cfg = (
        family.config(**{**asdict(family.smoke), **overrides})
        if smoke
        else family.config.preset(preset, **overrides)
    )
    return BenchModel(
        name=name,
        preset="smoke" if smoke else preset,
        build=lambda: family.make(cfg),
        tiny=lambda: family.make(family.tiny),
        parameters=family.parameters_count(cfg),
        flops_per_token=family.flops_per_token(cfg),
        vocab_size=cfg.vocab_size,
        seq_len=cfg.seq_len,
        shape=family.shape(cfg),
        config=asdict(cfg),
    )
