"""What the engine cannot follow after `initialize` is refused, never trained silently wrong.

On 2 gloo ranks at stages 1, 2 and 3 (see [Note: changes after initialize]):
`add_param_group` on the `ZeroOptimizer`, on the AdamW it wraps and on the Muon of
[Muon, AdamW] raises at the call on every rank, naming the way to unfreeze (once, the
layer frozen at initialize stayed unchanged after two steps); a parameter unfrozen or
frozen, a module converted by torchao (fp8 with its fp8 all-gather, which once trained
to wrong weights), replaced or added, a parameter replaced, added, set to None or
deleted, the model converted by `half()` and a param group appended by hand raise at the
next forward or step (`half()` at stages 2 and 3 at the call), naming the change;
nothing of that kind (the same module assigned again, a parameter-less activation added)
trains on, and so does a module replaced and then put back.
Unfreezing the way the errors say (a param group at lr 0, its lr set later) keeps the
layer's weights until then and trains them after.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks
from tests.engine import _float8
from tests.engine._models import make_model, muon_and_adamw
from tests.faults._engine import train_step


def _build(stage: int, freeze: bool = False, muon: bool = False) -> tuple[nn.Module, Any, Any]:
    """The odd model (its `l1` frozen if `freeze`) and the optimizers it was given."""
    model = make_model(11)
    if freeze:
        model.l1.requires_grad_(False)
    cfg: dict[str, Any] = {"stage": stage}
    if stage == 3:
        cfg.update(min_unit_params=1, persistence_threshold=0)
    if muon:
        optimizers: Any = muon_and_adamw(model)
    else:
        optimizers = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model, opt = zs.initialize(model, optimizers, cfg)
    return model, opt, optimizers


def _add_param_group(stage: int) -> None:
    l1 = "l1.weight"
    for target in ("zero", "inner", "muon"):
        model, opt, inner = _build(stage, freeze=True, muon=target == "muon")
        train_step(model, opt, 0)
        before = zs.full_state_dict(model)[l1]
        model.l1.requires_grad_(True)
        add = {"zero": opt, "inner": inner, "muon": inner[0] if target == "muon" else None}
        groups = len(opt.param_groups)
        with pytest.raises(ValueError, match=r"add_param_group after .*lr=0"):
            add[target].add_param_group({"params": list(model.l1.parameters())})
        assert len(opt.param_groups) == groups
        # Unfreezing without the optimizer is refused too, at the next forward.
        with pytest.raises(RuntimeError, match=r"parameter 'l1\.\w+' was frozen"):
            train_step(model, opt, 1)
        model.l1.requires_grad_(False)
        train_step(model, opt, 1)  # as it was: it trains on
        assert torch.equal(zs.full_state_dict(model)[l1], before)


def _checked(stage: int, change: Callable[[nn.Module, Any], None], match: str) -> None:
    """`change` after a step is refused (at the call, or at the next forward or step) on
    every rank."""
    model, opt, _ = _build(stage)
    train_step(model, opt, 0)
    with pytest.raises(RuntimeError, match=match):
        change(model, opt)
        train_step(model, opt, 1)


def _set(module: nn.Module, name: str, value: Any) -> None:
    setattr(module, name, value)


CHANGES: dict[str, tuple[Callable[[nn.Module, Any], None], str]] = {
    "frozen": (
        lambda m, o: m.l2.requires_grad_(False),
        r"parameter 'l2\.\w+' was trainable .* set its param group's lr",
    ),
    "module replaced": (
        lambda m, o: _set(m, "l2", nn.Linear(29, 13)),
        r"module 'l2' was replaced by a Linear after .* at the model's forward",
    ),
    "module added": (
        lambda m, o: m.blocks.append(nn.Linear(13, 13)),
        r"module 'blocks\.2' \(Linear\) was added",
    ),
    "parameter replaced": (
        lambda m, o: _set(m.blocks[0].up, "bias", nn.Parameter(torch.zeros(29))),
        r"parameter 'blocks\.0\.up\.bias' was replaced",
    ),
    "parameter added": (
        lambda m, o: _set(m.l1, "gain", nn.Parameter(torch.ones(1))),
        r"parameter 'l1\.gain' was added",
    ),
    "parameter set to None": (
        lambda m, o: _set(m.blocks[0].up, "bias", None),
        r"parameter 'blocks\.0\.up\.bias' was removed \(set to None or deleted\)",
    ),
    "parameter deleted": (
        lambda m, o: delattr(m.l2, "bias"),
        r"parameter 'l2\.bias' was removed",
    ),
    "model.half()": (
        lambda m, o: m.half(),
        # Stages 2 and 3 hold a guard in .grad, which half() converts: refused at the call.
        r"(parameter '[\w.]+' was torch\.float32 .* and is torch\.float16 now|"
        r"the model was converted \(model\.half\(\).*) .*precision\.compute_dtype",
    ),
    "param group appended": (
        lambda m, o: o.param_groups.append({**o.param_groups[0], "params": []}),
        r"the optimizer's param groups changed .* at the model's forward",
    ),
}


def _changes(stage: int) -> None:
    run_each(
        [{"stage": stage, "change": c, "match": m} for c, m in CHANGES.values()],
        _checked,
    )
    # What the engine needs not follow trains on; a change undone does too.
    model, opt, _ = _build(stage)
    model.l1 = model.l1  # the same module
    model.blocks[0].up.weight = model.blocks[0].up.weight  # the same parameter
    model.act = nn.GELU()  # no parameters
    train_step(model, opt, 0)
    l2 = model.l2
    model.l2 = nn.Linear(29, 13)
    with pytest.raises(RuntimeError, match="module 'l2' was replaced"):
        train_step(model, opt, 1)
    model.l2 = l2
    train_step(model, opt, 1)


def _float8_converted(stage: int) -> None:
    from torchao.float8 import convert_to_float8_training

    net = _float8.make_net(3, None, False, "cpu")
    cfg: dict[str, Any] = {"stage": stage}
    if stage == 3:
        cfg.update(min_unit_params=1, persistence_threshold=0)
    model, opt = zs.initialize(net, _float8.make_optimizer(net), cfg)
    tokens = _float8.batches(1, 1, 2)[0, 0, dist.get_rank()]
    _float8.loss_of(model, tokens).backward()
    opt.step()
    convert_to_float8_training(
        model,
        config=_float8.float8_config("tensorwise", True, "cpu"),
        module_filter_fn=lambda m, fqn: fqn.startswith("blocks"),
    )
    with pytest.raises(RuntimeError, match=r"module 'blocks\.0\.up' was replaced by a Float8"):
        _float8.loss_of(model, tokens).backward()


def _unfreeze_as_told(stage: int) -> None:
    """The way the errors name: `l1` in a param group at lr 0, its lr set to unfreeze."""
    model = make_model(11)
    later = list(model.l1.parameters())
    rest = [p for p in model.parameters() if p.requires_grad and all(p is not q for q in later)]
    opt = torch.optim.AdamW([{"params": rest}, {"params": later, "lr": 0.0}], lr=1e-2)
    model, opt = zs.initialize(model, opt, {"stage": stage})
    before = zs.full_state_dict(model)["l1.weight"]
    train_step(model, opt, 0)
    assert torch.equal(zs.full_state_dict(model)["l1.weight"], before)  # frozen at lr 0
    opt.param_groups[1]["lr"] = 1e-2
    train_step(model, opt, 1)
    assert not torch.equal(zs.full_state_dict(model)["l1.weight"], before)


def _all(stage: int) -> None:
    for body in (_add_param_group, _changes, _float8_converted, _unfreeze_as_told):
        body(stage)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_changes_after_initialize_are_refused(stage: int) -> None:
    run_ranks(_all, 2, stage, timeout_s=240)
