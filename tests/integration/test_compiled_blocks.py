"""The eager engine with every decoder layer under torch.compile (torchtitan's way of
compiling blocks, benchmarks.train_step's `zs3b`): the engine's hooks stay eager around
the layers' graphs.

A tiny `transformers` Llama (2 layers, each a stage-3 unit of its own) trains 3 steps on
2 gloo ranks at stages 1-3, eagerly, with each layer's `forward` compiled after
`initialize`, and with each layer compiled before it (aot_eager, fullgraph), beside a
single-process copy on the same global batch. The compiled runs must give the eager
run's losses and weights bit for bit, all must match the reference, and Dynamo must
capture one graph for both layers (no graph break, no recompile per layer). Compiled
before `initialize`, the layers' parameter names carry `_orig_mod.`: rank 0 warns.
"""

from __future__ import annotations

import warnings
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
    _build,
)


def _train(stage: int, compiled: str) -> tuple[list[Any], dict[str, Any], int]:
    """Losses (this rank's micro-batch), full weights and stage 3's gathers (else 0)
    after `STEPS` engine steps. `compiled`: "" (eager), "forward" (each layer's forward
    compiled after `initialize`) or "module" (each layer compiled before, torchtitan's
    order; its weights are returned without the wrapper's `_orig_mod.`)."""
    import torch
    import torch.distributed as dist

    import zeroshard.engine as zs

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _build("llama", tied=False)
    if compiled == "module":
        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = torch.compile(layer, backend="aot_eager", fullgraph=True)
    # At stage 3 the engine's hooks gather and release around every layer's graph.
    config = {"stage": stage, **UNIT_PER_LAYER}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = zs.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config)
    # Rank 0 warns that the names carry the compile wrapper's `_orig_mod.`.
    named = [w for w in caught if "_orig_mod." in str(w.message)]
    assert len(named) == (compiled == "module" and rank == 0), [str(w.message) for w in caught]
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
    weights = {k.replace("_orig_mod.", ""): v for k, v in zs.full_state_dict(model).items()}
    return losses, weights, gathers


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


def _all_cases() -> None:
    run_each(subtests({"stage": [1, 2, 3], "compiled": ["forward", "module"]}), _case)


def test_compiled_layers_match_the_eager_engine_and_the_reference() -> None:
    run_ranks(_all_cases, 2, timeout_s=300)
