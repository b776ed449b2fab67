"""Several optimizers combined as one (`CombinedOptimizer`), in one process: its `state`
reads and writes through to each optimizer's own, which stays its own (no optimizer's
`state` is re-pointed), so each one's torch `state_dict`, `load_state_dict`, `step`, an LR
scheduler and `zero_grad` on the combined one work as on the optimizers alone, bit for
bit. The engine's multi-rank runs with several optimizers are test_whole_matrix.py's.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from zeroshard.engine.runtime._optimizers import CombinedOptimizer


def _optimizers(model: nn.Sequential) -> list[torch.optim.Optimizer]:
    return [
        torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9),
        torch.optim.AdamW(model[1].parameters(), lr=0.01),
    ]


def _train(model: nn.Sequential, opt: torch.optim.Optimizer, steps: range) -> None:
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    for step in steps:
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(step))
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def test_state_reads_through_to_each_optimizer() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    reference = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    reference.load_state_dict(model.state_dict())
    opts = _optimizers(model)
    combined = CombinedOptimizer(opts)
    # A parameter not stepped yet reads as an empty entry of its own optimizer.
    w = model[1].weight
    assert combined.state.get(w) is None and w not in combined.state
    assert combined.state[w] == {} and w in opts[1].state and w not in opts[0].state
    del combined.state[w]
    # A tensor neither steps (a frozen group's master) reads as an empty entry, as in one
    # optimizer's state, which neither optimizer's state holds.
    other = torch.zeros(1)
    assert combined.state[other] == {} and other in combined.state
    assert all(other not in o.state for o in opts)
    assert combined.state.pop(other) == {} and combined.state.pop(other, None) is None
    _train(model, combined, range(3))
    ref_opts = _optimizers(reference)
    for step in range(3):
        # The two optimizers alone, each with its own scheduler: the same bits.
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(step))
        reference(x).square().sum().backward()
        for o in ref_opts:
            o.step()
            o.zero_grad()
            for pg in o.param_groups:
                pg["lr"] *= 0.5
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)
    assert all(p.grad is None for p in model.parameters())
    for o in opts:
        own = {id(p) for pg in o.param_groups for p in pg["params"]}
        assert o.state and all(id(p) in own for p in o.state)
    assert len(combined.state) == sum(len(o.state) for o in opts)
    assert set(map(id, combined.state)) == {id(p) for p in model.parameters()}
    # Each optimizer's own state_dict is the combined one's; a load into fresh ones
    # continues bit for bit.
    saved = combined.state_dict()
    assert [o.state_dict() for o in opts] == saved["optimizers"]
    again = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    again.load_state_dict(model.state_dict())
    fresh = CombinedOptimizer(_optimizers(again))
    fresh.load_state_dict(copy.deepcopy(saved))  # torch's load keeps the tensors given
    assert [pg["lr"] for pg in fresh.param_groups] == [pg["lr"] for pg in combined.param_groups]
    moment = fresh.state[again[1].weight]["exp_avg"]
    assert moment is fresh.optimizers[1].state[again[1].weight]["exp_avg"]
    for m, o in ((model, combined), (again, fresh)):
        for step in range(3, 5):
            x = torch.randn(4, 3, generator=torch.Generator().manual_seed(step))
            m(x).square().sum().backward()
            o.step()
            o.zero_grad()
    for a, b in zip(model.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)
