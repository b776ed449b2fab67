"""The planner knows what torchao's fp8 gather saves.

On two gloo ranks: the planned flat groups of a converted model on the meta device are
the engine's (layouts, which gather in fp8) and so are the stage-3 units' gathered bytes
(one byte per fp8 weight element); `estimate` counts the fp8 weights and prices fewer
gathered bytes than the same model gathered in bf16. `zeroshard-plan --fp8 tensorwise
--fp8-all-gather` says so in its table, and refuses the all-gather without tensorwise.
torchao's linears save the same tensors for backward as the ones they replace (the
compute-dtype input and weight), so the activations do not change.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch.distributed as dist

import zeroshard.engine as zs
from tests._dist import run_ranks
from tests.engine._float8 import make_net, make_optimizer
from zeroshard.engine import WireKind
from zeroshard.engine.planner._cli import main
from zeroshard.engine.planner._groups import plan_groups

CONFIG = {"stage": 3, "compute_dtype": "bf16", "min_unit_params": 1, "persistence_threshold": 0}


def _planned_as_built() -> None:
    world = dist.get_world_size()
    cfg = zs.ZeroConfig.from_dict(CONFIG)
    plans = {}
    for gather in (False, True):
        meta = make_net(0, "tensorwise", gather, "meta")
        plan = plan_groups(meta, cfg, world)
        net = make_net(0, "tensorwise", gather, "cpu")
        model, _ = zs.initialize(net, make_optimizer(net), cfg)
        state = zs.engine_state(model)
        assert [g.layout for g in state.groups] == [g.layout for g in plan.groups]
        built = [zs.float8_wire(g) is not None for g in state.groups]
        assert built == [g.wire is WireKind.FLOAT8 for g in plan.groups] and any(built) == gather
        assert state.stage3 is not None
        assert [u.nbytes for u in state.stage3.units] == [u.gathered_bytes for u in plan.units]
        plans[gather] = zs.estimate(meta, cfg, world, 2, 8), meta
    (wide, _), (narrow, meta) = plans[False], plans[True]
    fp8 = sum(b.up.weight.numel() + b.down.weight.numel() for b in meta.blocks)
    assert wide.float8 == 0 and narrow.float8 == fp8
    assert narrow.gathered < wide.gathered
    assert narrow.activations_peak == wide.activations_peak


def _plan(*args: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["1.3b", "--layers", "2", "--world", "8", *args])
    return code, out.getvalue() + err.getvalue()


def test_float8_plan() -> None:
    pytest.importorskip("torchao")
    run_ranks(_planned_as_built, 2)
    code, bf16 = _plan()
    code8, fp8 = _plan("--fp8", "tensorwise", "--fp8-all-gather")
    assert code == code8 == 0, fp8

    def gathered(table: str) -> float:
        line = next(x for x in table.splitlines() if x.startswith("| gathered units"))
        return float(line.rsplit("|", 2)[1])

    assert "fp8 for" in fp8 and "fp8 for" not in bf16
    assert gathered(fp8) < gathered(bf16)
    code, text = _plan("--fp8", "rowwise", "--fp8-all-gather")
    assert code == 2 and "--fp8-all-gather needs --fp8 tensorwise" in text
    # Without the all-gather the weights gather in bf16 as before.
    code, rowwise = _plan("--fp8", "rowwise")
    assert code == 0 and "fp8 for" not in rowwise
    assert gathered(rowwise) == gathered(bf16)
