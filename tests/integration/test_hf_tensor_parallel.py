"""A Hugging Face model split by its own `tp_plan`, sharded by zeroshard over dp.

A tiny `LlamaForCausalLM` (from a config, no download) is parallelized over the tp dim
of a dp 2 x tp 2 mesh with transformers' `apply_tensor_parallelism` and the model's own
`tp_plan` (vocab-split embedding, colwise q/k/v/gate/up, rowwise o/down, a head that
gathers its output), then `zs.initialize(..., device_mesh=mesh)` at stage 3. Against a
single-process copy on the global batch (fp32): the loss and clip norm of every step
(rtol 1e-5) and the final weights (test_hf_causal_lm's atol 5e-5 after AdamW at lr
1e-2); `full_state_dict` under HF's own names, and the consolidated checkpoint loads
into the unsplit model with `from_pretrained`, no key missing or unexpected, bit for bit
the weights `full_state_dict` had.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests._dist import run_ranks

pytest.importorskip("transformers")

VOCAB, SEQ, GLOBAL_BATCH, STEPS = 64, 8, 4, 2
WEIGHT_ATOL = 5e-5


def _config() -> Any:
    import transformers

    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * SEQ,
        tie_word_embeddings=False,
    )


def _train_and_export(root: str) -> None:
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    import zeroshard.engine as zs
    from benchmarks.train_step._tensor_parallel_engines import hf_plan
    from zeroshard.ckpt import consolidate

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config())
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(_config())
    # The model's own tp_plan, as benchmarks/train_step's hf-llama applies it.
    apply_tensor_parallelism(model, mesh["tp"], hf_plan(model))
    assert isinstance(model.model.layers[0].self_attn.o_proj.weight, DTensor)
    config = {"stage": 3, "min_unit_params": 1, "persistence_threshold": 0}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = zs.initialize(model, opt, config, device_mesh=mesh)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    dp_rank, per_rank = mesh.get_local_rank("dp"), GLOBAL_BATCH // 2
    for step in range(STEPS):
        ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
        mine = ids[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        norm = opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # 4 ranks, each dp rank's loss twice
        torch.testing.assert_close(mean / 4, ref_loss.detach(), rtol=1e-5, atol=0)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0, msg=f"step {step}")
    want = ref.state_dict()
    full = zs.full_state_dict(model)
    assert full.keys() == want.keys(), set(full) ^ set(want)
    for k, v in want.items():
        torch.testing.assert_close(full[k], v, atol=WEIGHT_ATOL, rtol=0, msg=k)
    zs.save_checkpoint(model, opt, Path(root) / "ckpt", step=STEPS)
    if dist.get_rank() == 0:
        out = Path(root) / "hf"
        consolidate(Path(root) / "ckpt", out)
        ref.config.save_pretrained(out)
        loaded, info = transformers.LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
        assert not any(v for k, v in info.items()), info
        got = loaded.state_dict()
        assert got.keys() == full.keys()
        for k, v in full.items():
            assert torch.equal(got[k], v), k
    dist.barrier()


@pytest.mark.slow
def test_hf_tp_plan_under_zeroshard(tmp_path: Path) -> None:
    run_ranks(_train_and_export, 4, str(tmp_path), timeout_s=300)
