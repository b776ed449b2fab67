"""examples/llama.py is the Llama that transformers builds from the same shapes.

With the weights copied across, `Llama` and `transformers.LlamaForCausalLM` (SDPA, untied
head, grouped-query attention, rotary tables) give the same logits (fp32, rtol 1e-5 /
atol 1e-5) and the same loss; `parameters_count` counts both exactly. The benchmark's
`hf-llama` wrapper returns that loss from `(idx, targets)` like the other models.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks._common._models import HFCausalLM, bench_model
from examples.llama import Llama, LlamaConfig, hf_config, parameters_count

# Odd enough to catch a wrong split: 3 query heads per k/v head, head_dim 8, 3 blocks.
CFG = LlamaConfig(
    vocab_size=61, d_model=48, n_layer=3, n_head=6, n_kv_head=2, ffn_hidden=72, seq_len=24
)

# examples/llama.py name -> LlamaForCausalLM name, per block and for the rest.
BLOCK = {
    "attn.q": "self_attn.q_proj",
    "attn.k": "self_attn.k_proj",
    "attn.v": "self_attn.v_proj",
    "attn.proj": "self_attn.o_proj",
    "mlp.gate": "mlp.gate_proj",
    "mlp.up": "mlp.up_proj",
    "mlp.proj": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "mlp_norm": "post_attention_layernorm",
}
TOP = {"tok_emb": "model.embed_tokens", "norm": "model.norm", "head": "lm_head"}


def _hf_name(name: str) -> str:
    module, _, leaf = name.rpartition(".")
    if module.startswith("blocks."):
        _, i, rest = module.split(".", 2)
        return f"model.layers.{i}.{BLOCK[rest]}.{leaf}"
    return f"{TOP[module]}.{leaf}"


def test_llama_matches_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ours = Llama(CFG)
    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**hf_config(CFG), attn_implementation="sdpa")
    )
    theirs = dict(hf.named_parameters())
    mine = dict(ours.named_parameters())
    assert len(mine) == len(theirs)
    assert sum(p.numel() for p in mine.values()) == parameters_count(CFG)
    assert sum(p.numel() for p in theirs.values()) == parameters_count(CFG)
    with torch.no_grad():
        for name, p in mine.items():
            theirs[_hf_name(name)].copy_(p)
    idx = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    targets = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    torch.testing.assert_close(ours(idx), hf(input_ids=idx).logits, rtol=1e-5, atol=1e-5)
    wrapped = HFCausalLM(hf)
    torch.testing.assert_close(wrapped(idx, targets), ours(idx, targets), rtol=1e-5, atol=1e-6)
    assert wrapped.blocks is hf.model.layers


def test_bad_shapes_and_presets_are_refused() -> None:
    with pytest.raises(ValueError, match="n_kv_head"):
        LlamaConfig(d_model=48, n_head=6, n_kv_head=4)
    with pytest.raises(ValueError, match="even width"):
        LlamaConfig(d_model=36, n_head=4)
    with pytest.raises(ValueError, match="unknown Llama preset"):
        LlamaConfig.preset("13b")
    with pytest.raises(ValueError, match="unknown model"):
        bench_model("mamba", "1.3b", smoke=True, seq_len=None, activation_checkpointing=False)
    with pytest.raises(ValueError, match="longer than seq_len"):
        Llama(CFG)(torch.zeros(1, CFG.seq_len + 1, dtype=torch.long))
