"""`zs.full_grad`, `zs.grad_norms` and `zs.full_optimizer_state` on a compiled stage-3 model
(the compiled graph reduce-scatters into the masters' gradients), against torch DDP on
the same two gloo ranks, as tests/engine/test_introspect.py does eagerly; the functions
take the `CompiledModel` itself. Accumulation and clipping in fp32 (test_introspect.py's
eager cases cover the dtypes: the gradient shards are the same); backend="aot_eager" (the
same graphs and passes, without C++ compilation on 2 shared cores)."""

from __future__ import annotations

import copy

import pytest
import torch.distributed as dist

import zeroshard.compile as zc
import zeroshard.engine as zs
from tests._dist import run_ranks, world_fits
from tests.engine._introspect import train_and_check
from tests.engine._models import global_batches, make_model, make_optimizer

CONFIG = {"stage": 3, "min_unit_params": 1, "persistence_threshold": 0}


def _compiled(device: str) -> None:
    base = make_model(seed=11)
    model = copy.deepcopy(base).to(device)
    model, opt = zs.initialize(model, make_optimizer(model), CONFIG)
    compiled = zc.compile(model, backend="aot_eager")
    batches = global_batches(2, 2, dist.get_world_size(), 2)
    train_and_check(
        compiled, opt, base, make_optimizer, batches, clip=True, tol=None, device=device
    )
    # Reading between steps costs the graph nothing: one capture for every step.
    assert not compiled.eager and compiled.compiles == 1


@pytest.mark.gpu
def test_compiled_gradients_and_state_match_ddp(device: str) -> None:
    world_fits(device, 2)
    run_ranks(_compiled, 2, device, device=device)
