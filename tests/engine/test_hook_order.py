"""The engine's forward pre-hooks iterate in the order they were inserted.

[Note: prepended hooks and Dynamo] in runtime/_hooks.py: torch 2.11's Dynamo guards a
module's hooks by their index in `dict.keys(module._forward_pre_hooks)` (the insertion
order) while it traces them in the OrderedDict's order; where the two differ,
`zeroshard.compile` falls back to eager. The engine prepends the change watch's hook on
the root module (which also has the precision hook) and stage 3's gather in front of
the hooks a module already has (a user's, here); on one gloo rank, at bf16 with the fp8
gather, every module's two orders must agree, and the prepended hooks must still run
first. On the code before runtime/_hooks.py the orders disagree on both modules.
"""

from __future__ import annotations

import torch
from torch import nn

import zeroshard.engine as zs
from tests._dist import run_ranks
from tests.engine import _float8


def _orders_agree(module: nn.Module) -> bool:
    hooks = module._forward_pre_hooks
    return list(dict.keys(hooks)) == list(hooks.keys())


def _body() -> None:
    net = _float8.make_net(0, "tensorwise", True, "cpu")
    seen: list[int] = []

    def user_hook(module: nn.Module, args: object) -> None:
        # Stage 3's gather ran first: the block's weights are there to read.
        seen.append(module.up.weight.numel())

    net.blocks[0].register_forward_pre_hook(user_hook)
    cfg = {"stage": 3, "compute_dtype": "bf16", "min_unit_params": 1, "persistence_threshold": 0}
    model, _ = zs.initialize(net, _float8.make_optimizer(net), cfg)
    for name, m in model.named_modules():
        assert _orders_agree(m), (name, list(dict.keys(m._forward_pre_hooks)))
    first = [h.__qualname__ for h in model._forward_pre_hooks.values()]
    assert first[0].startswith("ChangeWatch."), first
    assert any(h.startswith("install_precision_hooks.") for h in first), first
    names = [h.__qualname__ for h in model.blocks[0]._forward_pre_hooks.values()]
    assert names[0].startswith("Stage3Runtime.") and names[1].endswith("user_hook"), names
    tokens = _float8.batches(1, 1, 1)[0, 0, 0]
    _float8.loss_of(model, tokens).backward()  # the hooks still run, in that order
    assert seen and seen[0] > 0, seen  # gathered, not the released empty view
    assert torch.isfinite(next(model.parameters())).all()


def test_prepended_hooks_iterate_in_insertion_order() -> None:
    run_ranks(_body, 1)
