"""flatten_params / flatten_shard / unflatten in one process: bitwise round trips, bad input."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.partition._helpers import bitwise_equal, random_params, reference_flat
from tests.partition._strategies import layouts
from zeroshard.partition import (
    FlatLayout,
    FlattenTier,
    flatten_params,
    flatten_shard,
    unflatten,
)

CPU = torch.device("cpu")
LOCAL_TIERS = (FlattenTier.DEVICE, FlattenTier.CPU, FlattenTier.AUTO)


def _storage_ref(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._weak_ref())


def _expired(ref: int) -> bool:
    return bool(torch.UntypedStorage._expired(ref))


@settings(max_examples=60, deadline=None)
@given(layouts(), st.sampled_from(LOCAL_TIERS), st.integers(0, 2**16))
def test_flatten_then_unflatten_is_bitwise_identity(
    layout: FlatLayout, tier: FlattenTier, seed: int
) -> None:
    originals = random_params(layout, seed)
    params = [t.clone() for t in originals]
    refs = [_storage_ref(p) for p in params if p.numel()]
    flat, used = flatten_params(params, layout, device=CPU, tier=tier)
    assert used is (FlattenTier.DEVICE if tier is FlattenTier.AUTO else tier)
    assert flat.shape == (layout.padded_numel,) and flat.dtype == layout.dtype
    assert not flat.requires_grad
    # Padding zeroed, every slot in place: equal to the buffer built the obvious way.
    assert bitwise_equal(flat, reference_flat(originals, layout))
    views = unflatten(flat, layout)
    assert list(views) == [s.name for s in layout.slots]
    for p, orig, s in zip(params, originals, layout.slots, strict=True):
        assert bitwise_equal(views[s.name], orig)
        assert bitwise_equal(p, orig)
        if p.numel():
            # The param is now a view of the buffer, at its slot.
            assert p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            assert p.data_ptr() == flat.data_ptr() + s.offset * flat.element_size()
    # The original storages are gone: nothing in flatten keeps them alive.
    assert all(_expired(r) for r in refs)
    for rank in range(layout.world_size):
        lo, hi = layout.shard_range(rank)
        assert bitwise_equal(flatten_shard(originals, layout, rank, device=CPU), flat[lo:hi])


def test_flatten_shard_leaves_params_untouched() -> None:
    shapes = [("a", (3, 5)), ("b", ()), ("c", (0, 4)), ("d", (7,))]
    layout = FlatLayout.build(shapes, torch.float32, 3, alignment=4)
    params = random_params(layout, 1)
    ptrs = [p.data_ptr() for p in params]
    before = [p.clone() for p in params]
    shards = [flatten_shard(params, layout, r, device=CPU) for r in range(3)]
    assert [p.data_ptr() for p in params] == ptrs
    assert all(bitwise_equal(p, b) for p, b in zip(params, before, strict=True))
    assert bitwise_equal(torch.cat(shards), reference_flat(before, layout))
    with pytest.raises(ValueError, match="rank 3 out of range"):
        flatten_shard(params, layout, 3, device=CPU)


def test_flattened_parameters_still_train() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    ref = [p.detach().clone() for p in model.parameters()]
    named = list(model.named_parameters())
    layout = FlatLayout.build([(n, p.shape) for n, p in named], torch.float32, 2, alignment=4)
    flat, _ = flatten_params([p for _, p in named], layout, device=CPU)
    x = torch.randn(5, 4)
    model(x).square().sum().backward()
    for (_, p), r in zip(named, ref, strict=True):
        assert isinstance(p, torch.nn.Parameter) and p.is_leaf and p.requires_grad
        assert p.grad is not None and p.grad.shape == r.shape
    # Autograd gave the gradient to the params, not to the buffer.
    assert flat.grad is None and not flat.requires_grad
    w0, b0, w1, b1 = (r.clone().requires_grad_() for r in ref)
    linear = torch.nn.functional.linear
    linear(linear(x, w0, b0), w1, b1).square().sum().backward()
    for (_, p), r in zip(named, (w0, b0, w1, b1), strict=True):
        assert torch.equal(p.grad, r.grad)
    # An in-place update through the buffer is seen by the params.
    flat.mul_(2)
    assert torch.equal(model[0].weight, 2 * ref[0])


def test_auto_on_cpu_is_device_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    layout = FlatLayout.build([("w", (4, 4))], torch.float32, 1)
    with caplog.at_level(logging.INFO, logger="zeroshard.partition"):
        _, tier = flatten_params(random_params(layout, 0), layout, device=CPU)
    assert tier is FlattenTier.DEVICE
    assert "tier device" in caplog.text and "1 params" in caplog.text


def _layout() -> FlatLayout:
    return FlatLayout.build([("w", (2, 3)), ("b", (3,))], torch.float32, 2)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: [torch.zeros(2, 3, dtype=torch.float16), torch.zeros(3)], "'w' has dtype"),
        (lambda: [torch.zeros(2, 3), torch.zeros(4)], "'b' has shape"),
        (lambda: [torch.zeros(3, 2).t(), torch.zeros(3)], "'w' is not contiguous"),
        (lambda: [torch.zeros(2, 3)], "got 1 parameters for a layout of 2"),
        (lambda: [torch.zeros(2, 3), torch.zeros(3), torch.zeros(1)], "got 3 parameters"),
    ],
)
def test_bad_input_is_a_value_error_naming_the_parameter(make, match) -> None:  # type: ignore[no-untyped-def]
    params = make()
    for tier in (FlattenTier.DEVICE, FlattenTier.CPU, FlattenTier.DISTRIBUTED):
        with pytest.raises(ValueError, match=match):
            flatten_params(params, _layout(), device=CPU, tier=tier)
    with pytest.raises(ValueError, match=match):
        flatten_shard(params, _layout(), 0, device=CPU)


def test_shared_storage_is_rejected_and_params_are_left_alone() -> None:
    base = torch.arange(9.0)
    w, b = base[:6].view(2, 3), base[6:]
    with pytest.raises(ValueError, match="'w' and 'b' share storage"):
        flatten_params([w, b], _layout(), device=CPU)
    tied = torch.zeros(3)
    layout = FlatLayout.build([("x", (3,)), ("y", (3,))], torch.float32, 1)
    with pytest.raises(ValueError, match="'x' and 'y' share storage"):
        flatten_params([tied, tied], layout, device=CPU)
    assert w.data_ptr() == base.data_ptr() and torch.equal(base, torch.arange(9.0))


def test_distributed_tier_needs_a_group() -> None:
    layout = _layout()
    with pytest.raises(ValueError, match="needs a process group"):
        flatten_params(random_params(layout, 0), layout, device=CPU, tier=FlattenTier.DISTRIBUTED)
    with pytest.raises(ValueError, match="FlattenTier"):
        flatten_params(random_params(layout, 0), layout, device=CPU, tier="device")  # type: ignore[arg-type]


def test_unflatten_rejects_a_wrong_buffer() -> None:
    layout = _layout()
    with pytest.raises(ValueError, match="1-D buffer of 10 elements"):
        unflatten(torch.zeros(9), layout)
    with pytest.raises(ValueError, match="1-D buffer"):
        unflatten(torch.zeros(2, 5), layout)
    with pytest.raises(ValueError, match="dtype"):
        unflatten(torch.zeros(10, dtype=torch.float64), layout)
