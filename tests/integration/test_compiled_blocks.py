"""The eager engine with every decoder layer's `forward` under torch.compile (torchtitan's
way of compiling blocks, benchmarks.train_step's `zs3b`): the engine's hooks stay eager
around the layers' graphs.

A tiny `transformers` Llama (2 layers) trains 3 steps on 2 gloo ranks at stages 1-3,
once eager and once with compiled layers (aot_eager, fullgraph), beside a single-process
copy on the same global batch. The compiled run must give the eager run's losses and
weights bit for bit, both must match the reference, and Dynamo must capture one graph
for both layers (no graph break, no recompile per layer).
"""

from __future__ import annotations

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
    VOCAB,
    WEIGHT_ATOL,
    _build,
)


def _train(stage: int, compiled: bool) -> tuple[list[Any], dict[str, Any]]:
    """Losses (this rank's micro-batch) and full weights after `STEPS` engine steps."""
    import torch
    import torch.distributed as dist

    import zeroshard.engine as zs

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _build("llama", tied=False)
    model, opt = zs.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), {"stage": stage}
    )
    if compiled:
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
    return losses, zs.full_state_dict(model)


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


def _case(stage: int) -> None:
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    world = dist.get_world_size()
    eager_losses, eager_weights = _train(stage, compiled=False)
    torch._dynamo.reset()
    counters.clear()
    losses, weights = _train(stage, compiled=True)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 1, f"stage {stage}: Dynamo captured {graphs} graphs for 2 identical layers"
    for step, (got, want) in enumerate(zip(losses, eager_losses, strict=True)):
        assert torch.equal(got, want), f"stage {stage} step {step}: loss {got} != eager {want}"
    assert weights.keys() == eager_weights.keys()
    for k, v in eager_weights.items():
        assert torch.equal(weights[k], v), f"stage {stage}: {k} differs from the eager engine's"

    ref_losses, ref_weights = _reference()
    for step, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
        mean = got.clone()
        dist.all_reduce(mean)
        torch.testing.assert_close(
            mean / world, want, rtol=LOSS_RTOL, atol=0, msg=f"stage {stage} step {step}"
        )
    for k, v in ref_weights.items():
        torch.testing.assert_close(
            weights[k], v, atol=WEIGHT_ATOL, rtol=0, msg=f"stage {stage}: {k}"
        )


def _all_cases() -> None:
    run_each(subtests({"stage": [1, 2, 3]}), _case)


def test_compiled_layers_match_the_eager_engine_and_the_reference() -> None:
    run_ranks(_all_cases, 2, timeout_s=300)
