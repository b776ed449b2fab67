"""`gathered_parameters`: full fp32 values inside, edits kept only from `modifier_rank`.

Each case trains against a plain single-process reference that sees the global batch
and receives the same edit at the same point: step 1; forward and backward of step 2
(stage 3 leaves the root unit gathered there); a read-only context (values must equal
`full_state_dict` bit for bit; an edit there must vanish); an edit of two weights from
rank 1 (the other ranks write garbage, which must lose); the step; step 3, whose forward
must already compute with the edited weights. SGD with momentum keeps the bf16 update
linear in the gradients, so its error against the fp32 reference stays at bf16 rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks, subtests, world_fits
from tests.engine._models import global_batches, loss_fn, make_model, make_optimizer
from zeroshard.engine.runtime._unit import UnitState
from zeroshard.engine.state._gathered import gathered_parameters

EDITED = ("l1.weight", "blocks.1.up.weight")
MODIFIER = 1


def _config(stage: int, dtype: str) -> dict[str, object]:
    config: dict[str, object] = {
        "stage": stage,
        "compute_dtype": dtype,
        "reduce_dtype": "fp32",
        "reduce_bucket_bytes": 1500,  # several flat groups on the tiny model
    }
    if stage == 3:
        config.update(min_unit_params=1, persistence_threshold=0)
    return config


def _edits(model: nn.Module) -> dict[str, torch.Tensor]:
    """fp32 values no bf16 can hold (a rounding on the way would show), same on all ranks."""
    g = torch.Generator().manual_seed(99)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    return {n: torch.randn(shapes[n], generator=g) * 0.1 for n in EDITED}


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


def _step(model: nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> torch.Tensor:
    loss = loss_fn(model, tokens)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _assert_forward_close(ours: torch.Tensor, ref: torch.Tensor, dtype: str) -> None:
    """fp32: elementwise. bf16: in norm (kernels round differently per device); stale
    weights would be off by about 100%, bf16 rounding by about 1%."""
    if dtype == "fp32":
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    else:
        err = float((ours - ref).norm() / ref.norm())
        assert err < 0.05, f"forward differs from the reference by {err:.1%}"


def _case(device: str, stage: int, dtype: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(seed=7 + stage).to(device)
    ref = copy.deepcopy(model).cpu()
    ref_opt = make_optimizer(ref, "sgd")
    edits = _edits(model)
    batches = global_batches(3, 1, world, 2)
    model, opt = zs.initialize(model, make_optimizer(model, "sgd"), _config(stage, dtype))
    state = zs.engine_state(model)
    compute = state.config.precision.compute_dtype
    named = dict(model.named_parameters())

    # The reference: the same steps and the same edit on the whole global batch.
    ref_losses, ref_probe = [], torch.empty(0)
    for s in range(3):
        loss = loss_fn(ref, batches[s, 0].reshape(-1, batches.shape[-1]))
        loss.backward()
        if s == 1:
            with torch.no_grad():
                for n, v in edits.items():
                    ref.get_parameter(n).copy_(v)
                ref_probe = ref(batches[1, 0, rank, :, :-1])
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(float(loss.detach()))

    _step(model, opt, batches[0, 0, rank].to(device))
    loss_fn(model, batches[1, 0, rank].to(device)).backward()
    if state.stage3 is not None:
        assert state.stage3.units[0].state is UnitState.GATHERED, "the root stays gathered"
    before = zs.full_state_dict(model)
    kept = {n: p.detach().clone() for n, p in named.items()}

    # 1. Read (whole model): exact fp32 masters; an edit without modifier_rank vanishes.
    with gathered_parameters(model):
        for n, p in named.items():
            assert p.dtype == torch.float32 and p.shape == before[n].shape, n
            assert torch.equal(p.detach().cpu(), before[n]), f"{n} is not the master value"
        with torch.no_grad():
            named["l2.weight"].add_(1.0)
    _assert_equal(zs.full_state_dict(model), before, "after a discarded edit")
    if state.stage3 is not None:
        assert all(u.state is UnitState.RELEASED for u in state.stage3.units)
        assert all(p.numel() == 0 for p in named.values()), "stage 3 params stay released"
    else:
        for n, p in named.items():
            assert p.dtype == compute and torch.equal(p.detach(), kept[n]), n

    # 2. A submodule, edited without modifier_rank: discarded too.
    with gathered_parameters(model.blocks[0], model=model), torch.no_grad():
        model.blocks[0].up.weight.zero_()
    _assert_equal(zs.full_state_dict(model), before, "after a discarded submodule edit")

    # 3. Rank 1 edits two weights; the others scribble, and must lose.
    edited = gathered_parameters([named[n] for n in EDITED], MODIFIER, model=model)
    with edited, torch.no_grad():
        for n in EDITED:
            if rank == MODIFIER:
                named[n].copy_(edits[n].to(device))
            else:
                named[n].fill_(-7.0)
    after = zs.full_state_dict(model)
    _assert_equal(after, {**before, **edits}, "after the edit")
    if state.stage3 is None:
        for n in EDITED:
            assert torch.equal(named[n].detach().cpu(), edits[n].to(compute)), n

    # 4. Forward computes with the edit at once (stage 3: the compute shard was refreshed).
    with torch.no_grad():
        probe = model(batches[1, 0, rank, :, :-1].to(device)).float().cpu()
    _assert_forward_close(probe, ref_probe, dtype)

    # 5. Training goes on from the edited weights, as the reference's does.
    opt.step()
    opt.zero_grad()
    loss3 = _step(model, opt, batches[2, 0, rank].to(device))
    dist.all_reduce(loss3)
    final = zs.full_state_dict(model)
    for n in EDITED:
        assert not torch.equal(final[n], edits[n]), f"{n} did not train after the edit"
    expected = ref.state_dict()
    if dtype == "fp32":
        torch.testing.assert_close(float(loss3) / world, ref_losses[2], rtol=1e-5, atol=1e-6)
        for n, v in expected.items():
            torch.testing.assert_close(final[n], v, rtol=1e-5, atol=1e-6, msg=n)
    else:
        torch.testing.assert_close(float(loss3) / world, ref_losses[2], rtol=2e-2, atol=1e-2)
        # Steps 2 and 3 together, relative to the reference's (edit included in both).
        ours = torch.cat([(final[n] - after[n]).reshape(-1) for n in named])
        theirs = torch.cat([(expected[n] - after[n]).reshape(-1) for n in named])
        err = float((ours - theirs).norm() / theirs.norm())
        assert err < 0.05, f"training after the edit differs from the reference by {err:.1%}"


def _errors(device: str) -> None:
    model = make_model(seed=1).to(device)
    model, opt = zs.initialize(model, make_optimizer(model), _config(3, "fp32"))
    stranger = nn.Parameter(torch.zeros(3, device=device))
    for match, args, kwargs in [
        ("not managed by this zeroshard engine", ([model.l1.weight, stranger],), {"model": model}),
        ("pass the model too", (model.l1,), {}),
        ("needs the initialized model", ([model.l1.weight],), {}),
        ("modifier_rank 5 is outside", (model,), {"modifier_rank": 5}),
    ]:
        with pytest.raises(ValueError, match=match), gathered_parameters(*args, **kwargs):
            pass
    with gathered_parameters(model.l1, model=model):
        busy = gathered_parameters(model.l1.bias, model=model)
        with pytest.raises(ValueError, match="already gathered"), busy:
            pass
        # A lone parameter works (not iterated over its rows); a disjoint group nests.
        with gathered_parameters(model.blocks[1].down.weight, model=model):
            assert model.blocks[1].down.weight.shape == (13, 31)
    # A block that raises leaves the parameters restored, with no collective on exit.
    with pytest.raises(RuntimeError, match="boom"), gathered_parameters(model, modifier_rank=0):
        raise RuntimeError("boom")
    assert all(p.numel() == 0 for p in model.parameters())
    with gathered_parameters(model):  # and a later context still works
        assert model.l1.weight.shape == (29, 13)
    # A step inside an editing block is refused at its exit, on every rank: writing the
    # edits back would undo it (it once did, silently). The step stays.
    tokens = global_batches(1, 1, dist.get_world_size(), 2)[0, 0, dist.get_rank()].to(device)
    before = zs.full_state_dict(model)
    refused = pytest.raises(RuntimeError, match=r"changed inside gathered_parameters\(modifier")
    with refused, gathered_parameters(model, modifier_rank=0):
        with torch.no_grad():
            model.l1.weight.mul_(2)
        _step(model, opt, tokens)
    after = zs.full_state_dict(model)
    assert not torch.equal(after["l2.weight"], before["l2.weight"]), "the step was undone"
    assert not torch.equal(after["l1.weight"], 2 * before["l1.weight"]), "an edit was kept"


def _all(device: str) -> None:
    cases = subtests({"stage": [1, 2, 3], "dtype": ["fp32", "bf16"]})
    run_each(cases, lambda **c: _case(device, **c))
    _errors(device)


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [2, 3])
def test_gathered_parameters(world_size: int, device: str) -> None:
    world_fits(device, world_size)
    run_ranks(_all, world_size, device, device=device)
