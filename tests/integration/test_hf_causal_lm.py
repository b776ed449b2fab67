"""Hugging Face causal LMs on zeroshard: parity, HF-format export, generation, meta loading.

Every case trains a tiny transformers model (hidden 32, 2 layers, each a stage-3 unit)
from a config for 3 steps on 2 gloo ranks and a single-process copy on the same global
batch: the mean loss of every step and the final weights must match. The checkpoint is
then consolidated and loaded with `from_pretrained` (no missing or unexpected keys,
equal weights), and at stage 3 greedy generation must equal the unsharded model's.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from tests._dist import run_each, run_ranks, subtests

pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
VOCAB, SEQ, GLOBAL_BATCH, STEPS = 128, 16, 4, 3
LOSS_RTOL = 1e-5  # fp32: only the reduction order differs from the reference
WEIGHT_ATOL = 5e-5  # after 3 AdamW steps at lr 1e-2 (Adam amplifies tiny gradient differences)
# Each layer a stage-3 unit of its own, released after use: the tiny layers fall under the
# default thresholds, which would leave the root as the only unit.
UNIT_PER_LAYER = {"min_unit_params": 1, "persistence_threshold": 0}


def _config(arch: str, tied: bool, vocab: int = VOCAB) -> Any:
    import transformers

    if arch == "llama":
        return transformers.LlamaConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2 * SEQ,
            tie_word_embeddings=tied,
        )
    # GPT-2's dropout would draw different random numbers sharded and unsharded.
    return transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=2 * SEQ,
        tie_word_embeddings=tied,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


def _build(arch: str, tied: bool, vocab: int = VOCAB) -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(_config(arch, tied, vocab))


def _assert_from_pretrained_equal(directory: Path, want: dict[str, Any], what: str) -> None:
    import torch
    import transformers

    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, output_loading_info=True
    )
    bad = {k: v for k, v in info.items() if k != "error_msgs" and v}
    assert not bad and not info["error_msgs"], f"{what}: from_pretrained reported {info}"
    got = loaded.state_dict()
    assert got.keys() == want.keys(), f"{what}: keys {set(got) ^ set(want)}"
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, atol=WEIGHT_ATOL, rtol=0, msg=f"{what}: {k}")


def _parity_case(root: str, arch: str, tied: bool, stage: int, compiled: bool) -> None:
    import torch
    import torch.distributed as dist

    import zeroshard.engine as zs
    from zeroshard.ckpt import consolidate

    rank, world = dist.get_rank(), dist.get_world_size()
    what = f"{arch} tied={tied} stage={stage} compiled={compiled}"
    model, ref = _build(arch, tied), _build(arch, tied)
    config = {"stage": stage, **UNIT_PER_LAYER}
    model, opt = zs.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    forward: Any = model
    if compiled:
        import zeroshard.compile as zc

        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a fallback to eager fails the case
            forward = zc.compile(model, backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    per_rank = GLOBAL_BATCH // world
    for step in range(STEPS):
        ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
        mine = ids[rank * per_rank : (rank + 1) * per_rank]
        loss = forward(input_ids=mine, labels=mine).loss
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
        dist.all_reduce(mean)
        torch.testing.assert_close(mean / world, ref_loss.detach(), rtol=LOSS_RTOL, atol=0)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-4, atol=0, msg=f"{what} step {step}")
    if stage == 3:  # both layers gathered for forward and again for backward
        gathers = (forward.stats if compiled else zs.engine_stats(model)).gathers
        assert gathers >= 2 * 2 * STEPS, f"{what}: {gathers} gathers in {STEPS} steps"
    if compiled:
        assert not forward.eager and forward.compiles == 1, (
            f"{what}: eager={forward.eager} compiles={forward.compiles}"
        )
    want = ref.state_dict()
    full = zs.full_state_dict(model)
    assert full.keys() == want.keys()
    for k, v in want.items():
        torch.testing.assert_close(full[k], v, atol=WEIGHT_ATOL, rtol=0, msg=f"{what}: {k}")

    case_dir = Path(root) / what.replace(" ", "_").replace("=", "")
    zs.save_checkpoint(model, opt, case_dir / "ckpt", step=STEPS)
    if rank == 0:
        consolidate(case_dir / "ckpt", case_dir / "hf")
        ref.config.save_pretrained(case_dir / "hf")
        _assert_from_pretrained_equal(case_dir / "hf", want, what)

    if stage == 3:
        model.eval()
        ref.eval()
        prompt = torch.tensor([[1, 2, 3, 4, 5]])
        want_ids = ref.generate(prompt, max_new_tokens=8, do_sample=False)
        with zs.gathered_parameters(model):
            inside = model.generate(prompt, max_new_tokens=8, do_sample=False)
        # Without the context the engine gathers unit by unit on every forward.
        hooked = model.generate(prompt, max_new_tokens=8, do_sample=False)
        assert inside.tolist() == want_ids.tolist(), f"{what}: {inside} != {want_ids}"
        assert hooked.tolist() == want_ids.tolist(), f"{what}: {hooked} != {want_ids}"
    dist.barrier()


def _parity(root: str) -> None:
    cases = subtests({"arch": ["llama", "gpt2"], "tied": [False, True], "stage": [1, 2, 3]})
    # Compiled, untied and tied: the capture puts each gathered view in every module that
    # holds the parameter ([Note: functional capture]).
    cases += [{"arch": "llama", "tied": t, "stage": 3, "compiled": True} for t in (False, True)]
    run_each(
        cases,
        lambda arch, tied, stage, compiled=False: _parity_case(root, arch, tied, stage, compiled),
    )


def _meta_load_and_example(root: str) -> None:
    """Pretrained weights straight into stage-3 shards of a meta model; the example end to end."""
    import torch
    import torch.distributed as dist
    import transformers

    import zeroshard.engine as zs
    from zeroshard.engine.huggingface import rebuild_meta_buffers

    src = Path(root) / "pretrained"
    ref = _build("llama", False, vocab=256)  # byte tokens in the example
    with torch.no_grad():  # weights unlike any init, so a load that missed one shows
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    if dist.get_rank() == 0:
        ref.save_pretrained(src)
    dist.barrier()

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_config("llama", False, 256))
    with pytest.raises(ValueError, match="meta device"):
        zs.initialize(model, torch.optim.AdamW(model.parameters()), {"stage": 3})
    rebuilt = rebuild_meta_buffers(model)
    assert rebuilt and all(n.endswith("inv_freq") for n in rebuilt), rebuilt
    model, _ = zs.initialize(
        model,
        torch.optim.AdamW(model.parameters()),
        {"stage": 3},
        param_init=model._init_weights,
    )
    report = zs.load_safetensors(model, src)
    assert not report.unexpected, report
    ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(3))
    model.eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits)

    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import hf_causal_lm  # type: ignore[import-not-found]

    out = Path(root) / "example"
    argv = ["--model", str(src), "--stage", "3", "--steps", "2", "--save-every", "1"]
    final = hf_causal_lm.main([*argv, "--batch", "2", "--seq-len", "16", "--output-dir", str(out)])
    if dist.get_rank() == 0:
        assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-1", "step-2"]
        _assert_from_pretrained_equal(out / "hf", final, "example export")


@pytest.mark.slow
def test_hf_models_match_reference_and_round_trip(tmp_path: Path) -> None:
    run_ranks(_parity, 2, str(tmp_path), timeout_s=400)


@pytest.mark.slow
def test_pretrained_into_meta_shards_and_example(tmp_path: Path) -> None:
    run_ranks(_meta_load_and_example, 2, str(tmp_path), timeout_s=200)
