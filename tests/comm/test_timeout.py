"""A collective that a peer skips, or a peer that leaves, fails with a labelled error."""

from __future__ import annotations

import datetime
import gc
import os
import time

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_ranks, world_fits
from tests.comm._data import rank_device
from zeroshard.comm import CollectiveTimeoutError, Group
from zeroshard.comm._inflight import drain, held_by_gloo

TIMEOUT_S = 1.5
# The error must come at the timeout, not at torch's own (much longer) group timeout.
SLACK_S = 5.0


def _fresh_group(blocking_wait: bool) -> Group:
    # A subgroup of its own: the abandoned collective leaves it unusable, not the world.
    if dist.get_backend() == "nccl":
        # Let our wait, not torch's watchdog, report the timeout and abort the communicator.
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
    pg = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=120))
    group = Group(pg, timeout=datetime.timedelta(seconds=TIMEOUT_S), blocking_wait=blocking_wait)
    # Both ranks meet once, so connections (NCCL: the communicator) exist before the test.
    group.barrier(label="warm-up")
    return group


def _skipped_collective() -> None:
    group, dev = _fresh_group(blocking_wait=True), rank_device()
    if group.rank == 0:
        out = torch.empty(2 * 8, device=dev)
        start = time.monotonic()
        handle = group.all_gather_into(out, torch.ones(8, device=dev), label="layers.7")
        with pytest.raises(CollectiveTimeoutError) as info:
            handle.wait()
        elapsed = time.monotonic() - start
        err = info.value
        assert err.op == "all_gather" and err.label == "layers.7", str(err)
        assert err.timed_out, str(err)
        msg = str(err)
        assert "all_gather for 'layers.7'" in msg and "within 1.5s" in msg, msg
        assert 0.9 * TIMEOUT_S <= elapsed <= TIMEOUT_S + SLACK_S, elapsed
    # Rank 1 skipped it and is alive meanwhile, waiting here on the world group.
    Group().barrier(label="after timeout")


def _peer_leaves() -> None:
    group = _fresh_group(blocking_wait=True)
    if group.rank == 1:
        # Leaving the group closes this rank's connections to it, as an exiting peer would.
        pg = group.pg
        dist.destroy_process_group(pg)
        del group, pg
        gc.collect()
        Group().barrier(label="left")
        return
    Group().barrier(label="left")
    start = time.monotonic()
    h = group.all_reduce(torch.ones(3), label="grad norm")
    with pytest.raises(CollectiveTimeoutError) as info:
        h.wait()
    err = info.value
    assert not err.timed_out and time.monotonic() - start < TIMEOUT_S, str(err)
    msg = str(err)
    assert "all_reduce for 'grad norm' failed" in msg and "peer" in msg, msg


def _body(device: str) -> None:
    _skipped_collective()
    if device == "cpu":
        # NCCL has no equivalent of a gloo peer closing its sockets mid-job.
        _peer_leaves()
    Group().barrier(label="end")


@pytest.mark.gpu
def test_skipped_collective_times_out_with_label(device: str) -> None:
    """Rank 1 skips an all-gather: rank 0 fails at ~1.5 s naming the op and its label;
    on gloo, a peer that left the group makes the next collective fail at once."""
    world_fits(device, 2)
    run_ranks(_body, 2, device, device=device)


def _abandoned_then_drained() -> None:
    # See [Note: gloo at interpreter exit] in zeroshard/comm/_inflight.py.
    pg = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=120))
    group = Group(pg).with_timeout(datetime.timedelta(seconds=TIMEOUT_S))
    group.barrier(label="warm-up")
    assert drain(), "a finished barrier's tensors were not let go"
    assert held_by_gloo() == 0
    if group.rank == 0:
        first = group.all_reduce(torch.ones(8), label="first")
        group.all_reduce(torch.ones(8), label="queued")  # dropped unwaited
        assert held_by_gloo() == 2  # one private alias per collective, held by gloo
        with pytest.raises(CollectiveTimeoutError):
            first.wait()
        del first
        start = time.monotonic()
        # gloo ends each abandoned collective by the group's own timeout, then lets go.
        assert drain(), f"gloo still holds {held_by_gloo()} tensor(s)"
        assert held_by_gloo() == 0 and time.monotonic() - start <= 2 * TIMEOUT_S + SLACK_S
    Group().barrier(label="drained")


def test_abandoned_gloo_collectives_drain_before_exit() -> None:
    """What a timed-out (and a never-waited) gloo collective held is let go within the
    group's timeout: the exit hook's wait for it ends, so no worker frees it later."""
    run_ranks(_abandoned_then_drained, 2)
