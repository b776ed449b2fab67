"""A pass that fails on the backward graph falls back to eager, like a failed capture.

World 2 on real process groups. The pipeline gets a real broken BACKWARD pass (it
erases the reduce-scatters' results while the gradients still use them, which fx
refuses). The backward graph is compiled with the forward, at the first call, so the
failure comes before any collective: the compiled model warns once, naming the pass's
error, runs the eager zeroshard model, and its weights after two steps are exactly
those of an eager engine trained alongside.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import fx

import zeroshard.compile as zc
import zeroshard.engine as zs
from tests._dist import run_ranks, world_fits
from tests.engine._models import VOCAB, loss_fn, make_model, make_optimizer

CONFIG = {"stage": 3, "min_unit_params": 1, "persistence_threshold": 0}


def drop_reduce_scatters(graph: fx.Graph, context: zc.PassContext) -> None:
    """Broken on purpose: erases nodes that still have users (fx raises)."""
    for node in list(graph.nodes):
        if node.target is torch.ops.zeroshard.reduce_scatter.default:
            graph.erase_node(node)


def _case(device: str) -> None:
    base = make_model(seed=7).to(device)
    eager = copy.deepcopy(base)
    eager, eager_opt = zs.initialize(eager, make_optimizer(eager), CONFIG)
    model, opt = zs.initialize(base, make_optimizer(base), CONFIG)
    pipeline = zc.default_pipeline().insert(0, drop_reduce_scatters, {zc.Phase.BACKWARD})
    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = zc.compile(model, backend=backend, pipeline=pipeline)
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            idx = torch.randint(0, VOCAB, (2, 6), generator=gen).to(device)
            for m, o in ((eager, eager_opt), (compiled, opt)):
                loss_fn(m, idx).backward()
                o.step()
                o.zero_grad()
    ours = [str(w.message) for w in caught if "zeroshard.compile" in str(w.message)]
    # Every rank falls back alike; rank 0 alone says so.
    assert len(ours) == (torch.distributed.get_rank() == 0), ours
    assert all("cannot capture" in m and "still had" in m for m in ours), ours
    assert compiled.eager
    for a, b in zip(
        zs.full_state_dict(eager).values(), zs.full_state_dict(model).values(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.gpu
def test_backward_pass_error_falls_back_to_eager(device: str) -> None:
    world_fits(device, 2)
    run_ranks(_case, 2, device, device=device)
