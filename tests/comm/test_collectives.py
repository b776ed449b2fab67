"""Group's collectives on real ranks, against results any rank computes on its own."""

from __future__ import annotations

import datetime
import functools

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_each, run_ranks, subtests, world_fits
from tests.comm._data import (
    assert_matches,
    groups_by_size,
    rank_data,
    rank_device,
    ranks_for,
    reduce_reference,
)
from zeroshard.comm import CollectiveTimeoutError, Group, completed_handle

DTYPES = (torch.float32, torch.bfloat16)
# 1 element, an odd size, and one past a power of two.
NUMELS = (1, 7, 1025)
OPS = ("sum", "avg", "max")


def _all_gather(group: Group, dtype: torch.dtype, numel: int, seed: int) -> None:
    world, me, dev = group.size, group.rank, rank_device()
    send = rank_data(me, seed, numel, dtype).to(dev)
    out = torch.full((world * numel,), 99, dtype=dtype, device=dev)
    h = group.all_gather_into(out, send, label="ag")
    assert not h.done and h.op == "all_gather" and h.label == "ag"
    h.wait()
    assert h.done
    h.wait()  # a second wait is a no-op
    expected = torch.cat([rank_data(r, seed, numel, dtype) for r in range(world)])
    assert torch.equal(out.cpu(), expected)


def _reduce_scatter(group: Group, op: str, dtype: torch.dtype, numel: int, seed: int) -> None:
    world, me, dev = group.size, group.rank, rank_device()
    inputs = [rank_data(r, seed, world * numel, dtype) for r in range(world)]
    send = inputs[me].to(dev, copy=True)
    out = torch.empty(numel, dtype=dtype, device=dev)
    group.reduce_scatter(out, send, op=op, label="rs").wait()  # type: ignore[arg-type]
    expected = reduce_reference(inputs, op)[me * numel : (me + 1) * numel]
    assert_matches(out, expected, dtype)
    assert torch.equal(send.cpu(), inputs[me]), "reduce_scatter modified its input"


def _all_reduce(group: Group, op: str, dtype: torch.dtype, numel: int, seed: int) -> None:
    world, me, dev = group.size, group.rank, rank_device()
    inputs = [rank_data(r, seed, numel, dtype) for r in range(world)]
    t = inputs[me].to(dev, copy=True)
    group.all_reduce(t, op=op, label="ar").wait()  # type: ignore[arg-type]
    assert_matches(t, reduce_reference(inputs, op), dtype)


def _broadcast(group: Group, dtype: torch.dtype, numel: int, seed: int) -> None:
    world, me, dev = group.size, group.rank, rank_device()
    for src in range(world):
        t = rank_data(me, seed + src, numel, dtype).to(dev)
        group.broadcast(t, src, label="bc").wait()
        assert torch.equal(t.cpu(), rank_data(src, seed + src, numel, dtype)), f"src {src}"


def _all_to_all(group: Group, dtype: torch.dtype, numel: int, seed: int) -> None:
    world, me, dev = group.size, group.rank, rank_device()

    def part(src: int, dst: int) -> int:  # uneven parts, some of them empty
        return (numel + 2 * src + dst) % 4 * numel // 4

    def sent(src: int) -> torch.Tensor:
        return rank_data(src, seed, sum(part(src, d) for d in range(world)), dtype)

    out = torch.full((sum(part(s, me) for s in range(world)),), 99, dtype=dtype, device=dev)
    splits_in = [part(me, d) for d in range(world)]
    splits_out = [part(s, me) for s in range(world)]
    h = group.all_to_all(out, sent(me).to(dev), splits_out, splits_in, label="a2a")
    assert h.op == "all_to_all"
    h.wait()
    expected = [sent(s).split([part(s, d) for d in range(world)])[me] for s in range(world)]
    assert torch.equal(out.cpu(), torch.cat(expected))


def _case(group: Group, collective: str, dtype: torch.dtype, numel: int, seed: int) -> None:
    name, _, op = collective.partition(":")
    if name == "all_gather":
        _all_gather(group, dtype, numel, seed)
    elif name == "reduce_scatter":
        _reduce_scatter(group, op, dtype, numel, seed)
    elif name == "all_reduce":
        _all_reduce(group, op, dtype, numel, seed)
    elif name == "all_to_all":
        _all_to_all(group, dtype, numel, seed)
    else:
        _broadcast(group, dtype, numel, seed)


def _group_properties(group: Group, size: int) -> None:
    # Groups of every size are ranks 0..size-1: group rank == world rank.
    assert group.rank == dist.get_rank() and group.size == size
    assert group.device == rank_device()
    assert group.backend == dist.get_backend()
    assert [group.global_rank(r) for r in range(size)] == list(range(size))
    timed = group.with_timeout(datetime.timedelta(seconds=5))
    assert timed.timeout.total_seconds() == 5 and timed.pg is group.pg
    # with_timeout sets the timeout of the process group itself: put the group's own back,
    # or the barrier below would wait 5 s at most for ranks still busy with smaller groups
    # (a loaded 2-core CI host took longer: gloo "Timed out waiting 5000ms for send").
    group.with_timeout(group.timeout)
    assert completed_handle().done
    group.barrier(label="start")


def _bad_inputs(group: Group) -> None:
    # Each error is raised before a collective is issued, on every rank alike.
    dev = rank_device()
    x = torch.zeros(4, device=dev)
    with pytest.raises(ValueError, match=r"all_gather_into 'w'.*expected"):
        group.all_gather_into(torch.zeros(4 * group.size + 1, device=dev), x, label="w")
    with pytest.raises(ValueError, match="dtype"):
        group.all_gather_into(torch.zeros(4 * group.size, dtype=torch.float64, device=dev), x)
    with pytest.raises(ValueError, match=r"reduce_scatter 'g'.*expected"):
        group.reduce_scatter(x, torch.zeros(4 * group.size + 1, device=dev), label="g")
    with pytest.raises(ValueError, match="dtype"):
        group.reduce_scatter(x, torch.zeros(4 * group.size, dtype=torch.bfloat16, device=dev))
    with pytest.raises(ValueError, match="contiguous"):
        group.all_reduce(torch.zeros(4, 2, device=dev).t())
    with pytest.raises(ValueError, match="unknown reduce op 'min'"):
        group.all_reduce(x, op="min")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="outside a group"):
        group.broadcast(x, group.size)
    with pytest.raises(ValueError, match=r"all_to_all 'a': input splits"):
        group.all_to_all(x, x, [4] + [0] * (group.size - 1), [5] * group.size, label="a")


def _body() -> None:
    collectives = ["all_gather", "broadcast", "all_to_all"]
    collectives += [f"{c}:{op}" for c in ("reduce_scatter", "all_reduce") for op in OPS]
    cases = subtests({"collective": collectives, "dtype": DTYPES, "numel": NUMELS})
    cases = [dict(c, seed=i) for i, c in enumerate(cases)]
    # Sizes in turn; ranks outside a smaller group wait for it at the final barrier.
    for size, group in sorted(groups_by_size().items()):
        if group is None:
            continue
        _group_properties(group, size)
        _bad_inputs(group)
        run_each(cases, functools.partial(_case, group))
    Group().barrier(label="end")


@pytest.mark.gpu
def test_collectives_match_reference(device: str) -> None:
    """Every collective x op x fp32/bf16 x sizes 1, 7, 1025, on groups of 1-4 ranks.

    One spawn of 4 ranks (CPU) or one rank per GPU (up to 4); the smaller groups are
    subgroups of ranks 0..k-1 and the largest is the world group.
    """
    world = ranks_for(device)
    world_fits(device, world)
    run_ranks(_body, world, device=device)


def test_error_names_op_and_label() -> None:
    """The message reads right both for a real timeout and for a peer that went away."""
    timeout = datetime.timedelta(seconds=2)
    slow = CollectiveTimeoutError("all_gather", "layer3", timeout, RuntimeError("x"), 2.0)
    assert slow.timed_out and "all_gather for 'layer3'" in str(slow)
    assert "did not finish within 2s" in str(slow)
    dead = CollectiveTimeoutError(
        "reduce_scatter", "", timeout, RuntimeError("Connection closed by peer"), 0.1
    )
    assert not dead.timed_out and "failed after 0.1s" in str(dead)
    assert "Connection closed by peer" in str(dead) and "peer exit" in str(dead)
