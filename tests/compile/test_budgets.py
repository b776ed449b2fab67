"""Compile's budgets default from the engine's config (bytes); offload_params is refused
(the graph takes every shard at its start; offload_optimizer alone compiles:
test_compiled_offload.py)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch.distributed as dist
from torch import fx

import zeroshard.compile as zc
import zeroshard.engine as zs
from tests._dist import run_each, run_ranks, world_fits
from tests.engine._models import global_batches, loss_fn, make_model, make_optimizer

CONFIG = {"stage": 3, "min_unit_params": 1, "persistence_threshold": 0}
MICRO = 2


def _budgets_case(device: str) -> None:
    """`prefetch_bytes` as is, `persistence_threshold` as the bytes of the units it keeps
    gathered."""
    base = make_model(seed=7).to(device)
    config = {**CONFIG, "persistence_threshold": 10**9, "prefetch_bytes": 12_345}
    model, opt = zs.initialize(base, make_optimizer(base), config)
    seen: set[tuple[int, int]] = set()

    def record(graph: fx.Graph, context: zc.PassContext) -> None:
        seen.add((context.prefetch_bytes, context.persist_bytes))

    compiled = zc.compile(model, backend="aot_eager", pipeline=zc.default_pipeline().append(record))
    batches = global_batches(1, 1, dist.get_world_size(), MICRO)
    loss_fn(compiled, batches[0, 0, dist.get_rank()].to(device)).backward()
    opt.zero_grad()
    runtime = zs.engine_state(model).stage3
    assert runtime is not None
    # Every unit is under the threshold; the root is persistent for its hooks' sake only.
    small = sum(u.nbytes for u in runtime.units[1:])
    assert small > 0 and seen == {(12_345, small)}, seen


def _offload_case(device: str) -> None:
    base = make_model(seed=8).to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unfused-optimizer hint
        config = {**CONFIG, "offload_optimizer": True, "offload_params": True}
        model, _ = zs.initialize(base, make_optimizer(base), config)
    with pytest.raises(ValueError, match="offload_params: the compiled graph takes every"):
        zc.compile(model, backend="aot_eager")


def _cases(device: str) -> None:
    def body(case: str, **kw: Any) -> None:
        if case == "budgets":
            _budgets_case(device)
        else:
            _offload_case(device)

    run_each([{"case": "budgets"}, {"case": "offload"}], body)


@pytest.mark.gpu
def test_budgets_default_from_the_engine_and_offload_params_is_refused(device: str) -> None:
    world_fits(device, 2)
    run_ranks(_cases, 2, device, device=device)
