"""The host gradient norm ([Note: host gradient norm]): a shard's 2-norm as the norm of
its rows' norms, on every core; the same bits at any thread count, and clipping with
offload gives the same norm and weights as without it on shards of many rows."""

from __future__ import annotations

import torch
import torch.distributed as dist

import zeroshard.engine as zs
from tests._dist import run_ranks
from tests.engine._models import OddModel, global_batches, loss_fn, make_optimizer
from zeroshard.engine.runtime._host_norm import NORM_ROW, shard_norm


def test_shard_norm_accurate_and_thread_independent() -> None:
    g = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    for numel in (0, 5, NORM_ROW, 3 * NORM_ROW + 123):
        x = torch.randn(numel, generator=g) * 1e-3
        try:
            torch.set_num_threads(1)
            one = shard_norm(x)
            torch.set_num_threads(2)
            two = shard_norm(x)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one, two), numel
        want = torch.linalg.vector_norm(x.double())
        torch.testing.assert_close(one.double(), want, rtol=1e-6, atol=0.0)


def _clip_many_rows() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = global_batches(2, 1, world, 2)
    runs = []
    for offload in (True, False):
        torch.manual_seed(0)
        model = OddModel(d=67, hidden=1031)
        cfg = {"stage": 2, "compute_dtype": "bf16", "offload_optimizer": offload}
        model, opt = zs.initialize(model, make_optimizer(model), cfg)
        held = zs.engine_state(model).offload
        if offload:
            assert held is not None
            sizes = [g.layout.shard_numel for g in opt.flat_groups if held.holds(g)]
            assert max(sizes) > 2 * NORM_ROW, sizes  # shards of several rows and a tail
        norms = []
        for step in range(2):
            loss_fn(model, batches[step, 0, rank]).backward()
            norms.append(opt.clip_grad_norm_(0.05))
            opt.step()
            opt.zero_grad()
        runs.append((norms, zs.full_state_dict(model)))
    (norms, ours), (ref_norms, ref) = runs
    for a, b in zip(norms, ref_norms, strict=True):
        assert torch.equal(a, b), (a, b)
    for name, want in ref.items():
        assert torch.equal(ours[name], want), f"{name} differs from the step without offload"


def test_offload_clip_same_norm_on_many_rows() -> None:
    run_ranks(_clip_many_rows, 2)
