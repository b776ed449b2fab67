"""Inductor runs the kernels of a compiled fp8 model in the order the passes left.

One rank, a 4-block model with torchao's tensorwise fp8 linears, compiled by inductor
with no fusing of gathers (each block gathered on its own). The passes put each block's
gather wait just before that block's compute; inductor's `reorder_for_peak_memory`
moved every wait (with the weights' casts) ahead of the first matmul on an H200 ([Note:
inductor keeps the passes' order] in zeroshard.compile). So: the passes see that option
off, and in the generated forward, every block after the first waits for its weights
after a matmul of an earlier block. CPU ranks emulate fp8 (inductor lowers them to plain
matmuls); the `gpu` run is where the reordering was seen. A user's `options` that turn
the reordering back on reach inductor.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch._inductor.utils import run_and_get_code

import zeroshard.compile as zc
import zeroshard.engine as zs
from tests._dist import run_ranks
from tests.engine._float8 import Block, Net, batches, float8_config, loss_of, make_optimizer

BLOCKS = 4
CONFIG = {"stage": 3, "compute_dtype": "bf16", "min_unit_params": 1, "persistence_threshold": 0}


def _forward_calls(code: str) -> list[str]:
    """The kernel and collective calls of a generated module's `call`, in order."""
    body = code.split("def call(self, args):", 1)[1].split("\n    return ", 1)[0]
    return [line.strip() for line in body.splitlines() if "(" in line]


def _record_reorder_flag(seen: list[bool]) -> zc.Pipeline:
    """The default pipeline, and a forward pass noting inductor's reorder flag in `seen`."""

    def record(graph: torch.fx.Graph, context: zc.PassContext) -> None:
        seen.append(torch._inductor.config.reorder_for_peak_memory)

    return zc.default_pipeline().append(record, {zc.Phase.FORWARD})


def _case(device: str) -> None:
    from torchao.float8 import convert_to_float8_training

    torch.manual_seed(0)
    net = Net()
    net.blocks.extend(Block() for _ in range(BLOCKS - len(net.blocks)))
    convert_to_float8_training(
        net.to(device),
        config=float8_config("tensorwise", False, device),
        module_filter_fn=lambda m, fqn: fqn.startswith("blocks"),
    )
    model, _ = zs.initialize(net, make_optimizer(net), CONFIG)
    seen: list[bool] = []
    compiled = zc.compile(model, pipeline=_record_reorder_flag(seen), fuse_bytes=0)
    tokens = batches(1, 1, dist.get_world_size())[0, 0, 0].to(device)
    _, codes = run_and_get_code(lambda: loss_of(compiled, tokens).backward())
    assert not compiled.eager
    forward = next(c for c in codes if "zeroshard.account" in c and "reduce_scatter" not in c)
    calls = _forward_calls(forward)
    waits = [i for i, c in enumerate(calls) if "wait_tensor" in c]
    matmuls = [i for i, c in enumerate(calls) if re.search(r"_scaled_mm|extern_kernels\.a?mm", c)]
    assert len(waits) >= BLOCKS and matmuls, calls
    # The embedding's and the first block's waits come before any matmul; every later
    # block's after one (inductor's reordering put all of them first).
    late = [w for w in waits if w > matmuls[0]]
    assert len(late) >= BLOCKS - 1, "\n".join(calls)
    assert seen == [False]


@pytest.mark.gpu
def test_inductor_keeps_the_passes_order(device: str) -> None:
    pytest.importorskip("torchao")
    run_ranks(_case, 1, device, device=device, timeout_s=400)


def _override_case(device: str) -> None:
    torch.manual_seed(0)
    net = Net().to(device)
    model, _ = zs.initialize(net, make_optimizer(net), CONFIG)
    seen: list[bool] = []
    options = {"reorder_for_peak_memory": True}
    compiled = zc.compile(model, pipeline=_record_reorder_flag(seen), options=options)
    tokens = batches(1, 1, dist.get_world_size())[0, 0, 0].to(device)
    loss_of(compiled, tokens).backward()
    assert not compiled.eager
    assert seen == [True]


@pytest.mark.gpu
def test_user_options_turn_the_reordering_back_on(device: str) -> None:
    run_ranks(_override_case, 1, device, device=device, timeout_s=300)
