"""`model.state_dict()` / `load_state_dict()` on the engine's model behave as on the original.

On 2 gloo ranks at stages 1-3, fp32 and bf16 compute: the state dict holds full tensors
equal to `zs.full_state_dict` (the fp32 masters; also under `delay_param_update`, whose
parameters are a step behind; with `state_dict_on_rank0` only rank 0 gets them, on the
CPU); loading a full state dict puts it into the masters, so the next step
matches a single-process reference that loaded the same values; a missing or misshapen
key is torch's usual error; a stage-3 submodule's state dict names `zs.full_state_dict`.
Hugging Face: a tiny Llama's `save_pretrained` from the engine's model (bf16 compute at
stage 1 included) loads back with `from_pretrained` equal to the fp32 masters, and
`load_state_dict` of another Llama's weights makes the engine's forward equal that
Llama's (fp32).
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks, subtests
from tests.engine._models import global_batches, loss_fn, make_model, make_optimizer


def _config(stage: int, dtype: str = "fp32") -> dict[str, object]:
    config: dict[str, object] = {
        "stage": stage,
        "compute_dtype": dtype,
        "reduce_bucket_bytes": 1500,
    }
    if stage == 3:
        config.update(min_unit_params=1, persistence_threshold=0)
    return config


def _assert_same(ours: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert ours.keys() == want.keys(), f"{what}: keys {set(ours) ^ set(want)}"
    for k, v in want.items():
        assert ours[k].shape == v.shape and ours[k].dtype == v.dtype, f"{what}: {k}"
        assert torch.equal(ours[k].cpu(), v.cpu()), f"{what}: {k} differs"


def _plain_case(stage: int, dtype: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = global_batches(2, 1, world, 2)
    model = make_model(seed=5)
    # The reference takes the same steps (and so has the same momentum) on the global batch.
    ref = copy.deepcopy(model)
    ref_opt = make_optimizer(ref, "sgd")
    model, opt = zs.initialize(model, make_optimizer(model, "sgd"), _config(stage, dtype))
    loss_fn(model, batches[0, 0, rank]).backward()
    opt.step()
    opt.zero_grad()
    loss_fn(ref, batches[0, 0].reshape(-1, batches.shape[-1])).backward()
    ref_opt.step()
    ref_opt.zero_grad()

    full = zs.full_state_dict(model)
    sd = model.state_dict()
    # The masters in the parameters' own dtype (fp32) at every stage and compute dtype:
    # gathered at stage 3 and in mixed precision, read off the parameters at stages 1/2 fp32.
    _assert_same(sd, full, "state_dict")
    with zs.state_dict_on_rank0(model):
        with zs.state_dict_on_rank0(model):  # nested: the outer block's mode holds after
            pass
        on0 = model.state_dict()
    if rank == 0:
        assert all(v.device.type == "cpu" for v in on0.values())
        _assert_same(on0, sd, "state_dict on rank 0")
    else:
        assert on0 == {}, "other ranks get an empty dict"
    if stage == 3:
        with pytest.raises(RuntimeError, match=r"zs\.full_state_dict"):
            model.blocks[0].up.state_dict()
    assert model.state_dict(keep_vars=True)["l1.weight"] is model.l1.weight

    # Load other weights (as a plain module's state dict), then one more step: the
    # reference loads the same and steps the same batch.
    other = make_model(seed=11)
    ref.load_state_dict(other.state_dict())
    model.load_state_dict(other.state_dict())
    _assert_same(zs.full_state_dict(model), other.state_dict(), "after load_state_dict")
    loss = loss_fn(model, batches[1, 0, rank])
    loss.backward()
    opt.step()
    ref_loss = loss_fn(ref, batches[1, 0].reshape(-1, batches.shape[-1]))
    ref_loss.backward()
    ref_opt.step()
    total = loss.detach().reshape(1).float()
    dist.all_reduce(total)
    tol = 1e-5 if dtype == "fp32" else 2e-2
    assert abs(float(total) / world - float(ref_loss.detach())) < tol, "forward after load"
    if dtype == "fp32":
        after = zs.full_state_dict(model)
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(after[k], v, rtol=1e-5, atol=1e-6, msg=k)

    # Torch's own errors: a missing key (strict) and a wrong shape.
    partial = other.state_dict()
    del partial["l2.weight"]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*l2\.weight"):
        model.load_state_dict(partial)
    bad = other.state_dict()
    bad["l1.bias"] = torch.zeros(3)
    with pytest.raises(RuntimeError, match=r"size mismatch for l1\.bias"):
        model.load_state_dict(bad)
    # A dict on rank 0 only (as FSDP's rank0_only state dict is): refused on every rank.
    with pytest.raises(ValueError, match="every rank must pass the whole state dict"):
        model.load_state_dict(other.state_dict() if rank == 0 else {}, strict=False)


def _delayed_case() -> None:
    """delay_param_update: the parameters forward uses are a step behind the masters;
    state_dict() gives the masters, as full_state_dict does."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = global_batches(2, 1, world, 2)
    model = make_model(seed=5)
    config = {**_config(2), "offload_optimizer": True, "offload_delay_param_update": True}
    # The delayed step runs torch's fused AdamW on the host (the engine refuses others).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model, opt = zs.initialize(model, optimizer, config)
    for step in range(2):
        loss_fn(model, batches[step, 0, rank]).backward()
        opt.step()
        opt.zero_grad()
    _assert_same(model.state_dict(), zs.full_state_dict(model), "state_dict, delayed update")


def _hf_case(stage: int, dtype: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    rank = dist.get_rank()
    config = LlamaConfig(
        vocab_size=61,
        hidden_size=24,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = zs.initialize(model, opt, _config(stage, dtype))
    tokens = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(rank))
    model(input_ids=tokens, labels=tokens).loss.backward()
    opt.step()
    opt.zero_grad()

    full = zs.full_state_dict(model)
    # One directory for both ranks: rank 0's name, broadcast.
    box = [tempfile.mkdtemp(prefix="zs_hf_") if rank == 0 else ""]
    dist.broadcast_object_list(box, src=0)
    out = Path(box[0])
    model.save_pretrained(out, is_main_process=rank == 0)
    dist.barrier()
    # The files hold the fp32 masters, as the model was fp32, bf16 compute included (whose
    # parameters make save_pretrained write "bfloat16" into config.json: name the dtype).
    loaded = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    _assert_same(loaded.state_dict(), full, "from_pretrained(save_pretrained(engine model))")

    torch.manual_seed(1)
    other = LlamaForCausalLM(config)
    model.load_state_dict(other.state_dict())
    _assert_same(zs.full_state_dict(model), other.state_dict(), "after load_state_dict")
    if dtype == "fp32":
        with torch.no_grad():
            ours = model(input_ids=tokens).logits
            want = other(input_ids=tokens).logits
        torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)


def _all() -> None:
    run_each(subtests({"stage": [1, 2, 3], "dtype": ["fp32", "bf16"]}), _plain_case)
    _delayed_case()
    run_each(
        [*subtests({"stage": [1, 2, 3], "dtype": ["fp32"]}), {"stage": 1, "dtype": "bf16"}],
        _hf_case,
    )


def test_state_dict_and_load_state_dict_as_on_the_original_module() -> None:
    run_ranks(_all, 2)
