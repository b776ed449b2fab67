"""The eager engine with every decoder layer under torch.compile (torchtitan's way of
compiling blocks, benchmarks.train_step's `zs3b`): the engine's hooks stay eager around
the layers' graphs.

A tiny `transformers` Llama (2 layers, each a stage-3 unit of its own) trains 3 steps on
2 gloo ranks at stages 1-3, eagerly, with each layer's `forward` compiled after
`initialize`, and with each layer compiled before it (aot_eager, fullgraph), beside a
single-process copy on the same global batch. The compiled runs must give the eager
run's losses and weights bit for bit, all must match the reference, and Dynamo must
capture one graph for both layers (no graph break, no recompile per layer).

Compiled before `initialize`, the layers' parameters are named `..._orig_mod.` by torch;
what the engine names drops that segment: `full_state_dict`, a checkpoint loaded into
the uncompiled model and consolidated for `from_pretrained`, and Hugging Face's weights
loaded into the compiled model by name.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest

from tests._dist import run_each, run_ranks, subtests

pytest.importorskip("transformers")

# The tiny Llama, its batch and tolerances are the Hugging Face parity tests'.
from tests.integration.test_hf_causal_lm import (
    GLOBAL_BATCH,
    LOSS_RTOL,
    SEQ,
    STEPS,
    UNIT_PER_LAYER,
    VOCAB,
    WEIGHT_ATOL,
    _assert_from_pretrained_equal,
    _build,
)


def _train(stage: int, compiled: str) -> tuple[list[Any], dict[str, Any], int]:
    """Losses (this rank's micro-batch), full weights and stage 3's gathers (else 0)
    after `STEPS` engine steps. `compiled`: "" (eager), "forward" (each layer's forward
    compiled after `initialize`) or "module" (each layer compiled before, torchtitan's
    order)."""
    import torch
    import torch.distributed as dist

    import zeroshard.engine as zs

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _build("llama", tied=False)
    if compiled == "module":
        _compile_layers(model)
    # At stage 3 the engine's hooks gather and release around every layer's graph.
    config = {"stage": stage, **UNIT_PER_LAYER}
    model, opt = zs.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    if compiled == "forward":
        for layer in model.model.layers:
            layer.forward = torch.compile(layer.forward, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(1)
    per_rank = GLOBAL_BATCH // world
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
        mine = ids[rank * per_rank : (rank + 1) * per_rank]
        # No KV cache: its per-layer state would make Dynamo compile once per layer.
        loss = model(input_ids=mine, labels=mine, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    gathers = zs.engine_stats(model).gathers if stage == 3 else 0
    return losses, zs.full_state_dict(model), gathers


def _compile_layers(model: Any) -> None:
    """torchtitan's order: each decoder layer replaced by its compiled wrapper."""
    import torch

    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = torch.compile(layer, backend="aot_eager", fullgraph=True)


def _reference() -> tuple[list[Any], dict[str, Any]]:
    """Mean losses and weights of a plain single-process run on the global batch."""
    import torch

    ref = _build("llama", tied=False)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
        loss = ref(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, ref.state_dict()


def _case(stage: int, compiled: str) -> None:
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    world, what = dist.get_world_size(), f"stage {stage} compiled={compiled}"
    eager_losses, eager_weights, eager_gathers = _train(stage, compiled="")
    torch._dynamo.reset()
    counters.clear()
    losses, weights, gathers = _train(stage, compiled)
    if stage == 3:
        # Both layers gathered for forward and again for backward, every step.
        assert gathers == eager_gathers >= 2 * 2 * STEPS, (gathers, eager_gathers)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 1, f"{what}: Dynamo captured {graphs} graphs for 2 identical layers"
    for step, (got, want) in enumerate(zip(losses, eager_losses, strict=True)):
        assert torch.equal(got, want), f"{what} step {step}: loss {got} != eager {want}"
    assert weights.keys() == eager_weights.keys()
    for k, v in eager_weights.items():
        assert torch.equal(weights[k], v), f"{what}: {k} differs from the eager engine's"

    ref_losses, ref_weights = _reference()
    for step, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
        mean = got.clone()
        dist.all_reduce(mean)
        torch.testing.assert_close(
            mean / world, want, rtol=LOSS_RTOL, atol=0, msg=f"{what} step {step}"
        )
    for k, v in ref_weights.items():
        torch.testing.assert_close(weights[k], v, atol=WEIGHT_ATOL, rtol=0, msg=f"{what}: {k}")


def _names_case(root: str, stage: int) -> None:
    import torch
    import torch.distributed as dist

    import zeroshard.engine as zs
    from zeroshard.ckpt import consolidate

    rank, what = dist.get_rank(), f"stage {stage}, layers compiled before initialize"
    hf_names = _build("llama", tied=False).state_dict()
    assert not any("_orig_mod." in k for k in hf_names)
    config = {"stage": stage, **UNIT_PER_LAYER}
    model = _build("llama", tied=False)
    _compile_layers(model)
    assert any("_orig_mod." in n for n, _ in model.named_parameters())
    model, opt = zs.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH // dist.get_world_size(), SEQ))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    opt.step()
    trained = zs.full_state_dict(model)
    assert trained.keys() == hf_names.keys(), f"{what}: {set(trained) ^ set(hf_names)}"
    assert not all(torch.equal(trained[k], v) for k, v in hf_names.items()), "no step taken"

    # A checkpoint of the compiled model loads into the uncompiled one...
    case = Path(root) / f"stage{stage}"
    zs.save_checkpoint(model, opt, case / "ckpt", step=1)
    plain = _build("llama", tied=False)
    plain, plain_opt = zs.initialize(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), config)
    assert zs.load_checkpoint(plain, plain_opt, case / "ckpt") == 1
    loaded = zs.full_state_dict(plain)
    for k, v in trained.items():
        assert torch.equal(loaded[k], v), f"{what}: checkpoint -> uncompiled model: {k}"
    # ... and consolidates into weights `from_pretrained` takes without a missing key.
    if rank == 0:
        consolidate(case / "ckpt", case / "hf")
        _build("llama", tied=False).config.save_pretrained(case / "hf")
        _assert_from_pretrained_equal(case / "hf", trained, what)
        _build("llama", tied=False).save_pretrained(case / "src")
    dist.barrier()
    # Hugging Face's weights load into the compiled model by name.
    report = zs.load_safetensors(model, case / "src")
    again = zs.full_state_dict(model)
    for k, v in hf_names.items():
        assert torch.equal(again[k], v), f"{what}: Hugging Face weights -> compiled: {k} ({report})"


def _all_cases(root: str) -> None:
    run_each(subtests({"stage": [1, 2, 3], "compiled": ["forward", "module"]}), _case)
    run_each(subtests({"stage": [2, 3]}), partial(_names_case, root))


def test_compiled_layers_match_the_eager_engine_and_the_reference(tmp_path: Path) -> None:
    run_ranks(_all_cases, 2, str(tmp_path), timeout_s=360)
