"""Compiled zeroshard stage 3 against eager zeroshard and a single-process reference.

World 2 on real process groups. fp32: losses, grad norms and final parameters match the
plain single-process reference (which sees the global batch) at rtol 1e-5 / atol 1e-6,
and the eager zeroshard losses at the same tolerance. bf16 compute: losses within 2e-2 of
eager zeroshard bf16, and the fused downcast halves the bytes gathered (no fp32 gather).
Recompilation: one capture over all steps, for each of several models compiled in one
process (no Dynamo reset between the cases). torch.optim.Muon with AdamW (torch's recipe)
trains a compiled model as it does an eager one and the reference, at the fp32 tolerance.
The fp32 case runs inductor; the others use backend="aot_eager" (the same graphs and
passes, without C++ compilation on 2 shared cores).
"""

from __future__ import annotations

import collections
import copy
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import fx, nn

import zeroshard.compile as zc
import zeroshard.engine as zs
from tests._dist import run_each, run_ranks, world_fits
from tests.engine._models import (
    global_batches,
    loss_fn,
    make_model,
    make_optimizer,
    muon_and_adamw,
    reference_run,
)

STEPS = 3
MICRO = 2
CONFIG = {"stage": 3, "min_unit_params": 1, "persistence_threshold": 0}


def _train(
    model: Any,
    opt: zs.ZeroOptimizer,
    batches: torch.Tensor,
    accum: int,
    clip: bool,
    device: str,
) -> tuple[list[float], list[float]]:
    """Train `model` (a module or a CompiledModel) on this rank's part of `batches`; the
    global mean loss and the grad norm of each step."""
    world, rank = dist.get_world_size(), dist.get_rank()
    losses, norms = [], []
    for step in range(batches.shape[0]):
        total = torch.zeros(1, device=device)
        for a in range(accum):
            loss = loss_fn(model, batches[step, a, rank].to(device)) / accum
            loss.backward()
            total += loss.detach()
        if clip:
            norms.append(float(opt.clip_grad_norm_(0.5)))
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses, norms


def _fp32_case(
    device: str, accum: int, clip: bool, backend: str, make_opt: Any = make_optimizer
) -> None:
    world = dist.get_world_size()
    base = make_model(seed=3 + accum).to(device)
    batches = global_batches(STEPS, accum, world, MICRO)
    ref_losses, ref_norms, ref_state = reference_run(
        base.cpu(), make_opt, batches, 0.5 if clip else None
    )
    eager = copy.deepcopy(base).to(device)
    eager, eager_opt = zs.initialize(eager, make_opt(eager), CONFIG)
    eager_losses, _ = _train(eager, eager_opt, batches, accum, clip, device)
    model = copy.deepcopy(base).to(device)
    model, opt = zs.initialize(model, make_opt(model), CONFIG)
    compiled = zc.compile(model, backend=backend)
    losses, norms = _train(compiled, opt, batches, accum, clip, device)
    assert not compiled.eager
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=1e-6)
    if clip:
        torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=1e-6)
    full = zs.full_state_dict(model)
    for name, ref in ref_state.items():
        torch.testing.assert_close(full[name], ref, rtol=1e-5, atol=1e-6, msg=name)
    # One capture for all steps (accumulation and clipping included): no recompilation.
    assert compiled.compiles == 1, compiled.compiles
    groups = zs.engine_state(model).groups
    trainable = sum(g.trainable for g in groups)
    # Forward gathers every group, backward again (recomputed, not saved), and each
    # trainable group's gradient is reduce-scattered once per backward.
    assert compiled.stats.gathers == 2 * len(groups) * STEPS * accum
    assert compiled.stats.reduce_scatters == trainable * STEPS * accum
    assert compiled.stats.live_bytes == 0  # every gathered buffer was released


class Branchy(nn.Module):
    """Data-dependent Python control flow: Dynamo cannot capture it in one graph."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 6) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
            if x.sum() > 0:  # a branch on a value: a graph break
                x = F.relu(x)
        return x


def _fallback_case(device: str) -> None:
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        m = Branchy().to(device)
        models.append(zs.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1), CONFIG))
    (eager, eager_opt), (model, opt) = models
    compiled = zc.compile(model, backend="aot_eager")
    x = torch.randn(3, 6, device=device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            for m, o in ((eager, eager_opt), (compiled, opt)):
                m(x).square().sum().backward()
                o.step()
                o.zero_grad()
    ours = [w for w in caught if "zeroshard.compile" in str(w.message)]
    # Every rank falls back alike; rank 0 alone says so.
    assert len(ours) == (torch.distributed.get_rank() == 0), [str(w.message) for w in caught]
    assert all("cannot capture" in str(w.message) for w in ours)
    assert compiled.eager
    for a, b in zip(
        zs.full_state_dict(eager).values(), zs.full_state_dict(model).values(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _bf16_case(device: str) -> None:
    world = dist.get_world_size()
    base = make_model(seed=5).to(device)
    batches = global_batches(STEPS, 1, world, MICRO)
    config = {**CONFIG, "compute_dtype": "bf16"}
    eager = copy.deepcopy(base)
    eager, eager_opt = zs.initialize(eager, make_optimizer(eager), config)
    eager_losses, _ = _train(eager, eager_opt, batches, 1, False, device)
    model, opt = zs.initialize(base, make_optimizer(base), config)
    dtypes: set[torch.dtype] = set()

    collectives: dict[zc.Phase, int] = {}
    reduce_scatters: collections.Counter[str] = collections.Counter()

    def gather_dtypes(graph: fx.Graph, context: zc.PassContext) -> None:
        # After the last pass: what the all-gathers actually send, and how many there are.
        c10d = torch.ops._c10d_functional
        ags = (c10d.all_gather_into_tensor.default, c10d.all_gather_into_tensor_out.default)
        starts = [n for n in graph.nodes if n.target in ags]
        dtypes.update(n.meta["val"].dtype for n in starts)
        collectives[context.phase] = len(starts)
        for rs in (c10d.reduce_scatter_tensor.default, c10d.reduce_scatter_tensor_out.default):
            reduce_scatters[rs.name()] += sum(n.target is rs for n in graph.nodes)

    pipeline = zc.default_pipeline().append(gather_dtypes)
    sizes = [g.layout.padded_numel * 2 for g in zs.engine_state(model).groups]  # bf16 bytes
    # Room to persist exactly one group (the smallest) from forward into backward.
    compiled = zc.compile(model, backend="aot_eager", pipeline=pipeline, persist_bytes=min(sizes))
    losses, _ = _train(compiled, opt, batches, 1, False, device)
    torch.testing.assert_close(losses, eager_losses, rtol=2e-2, atol=1e-2)
    # The fused downcast: no fp32 gather left in forward or backward, so exactly the bf16
    # bytes of every group travel (an fp32 gather would move twice that), twice a step but
    # for the persistent group, which backward does not gather again.
    assert dtypes == {torch.bfloat16}
    assert compiled.stats.gathers == STEPS * (2 * len(sizes) - 1)
    assert compiled.stats.bytes_gathered == STEPS * (2 * sum(sizes) - min(sizes))
    assert compiled.compiles == 1
    # The groups are tiny and prefetch chains their gathers: fused into fewer collectives.
    assert collectives[zc.Phase.FORWARD] < len(sizes), collectives
    # Each gradient is cast to fp32 for its reduce-scatter, which nothing else reads: every
    # trainable group's reduce-scatter is in place (the losses above say it is right).
    trained = sum(g.trainable for g in zs.engine_state(model).groups)
    assert reduce_scatters == collections.Counter(
        {"_c10d_functional::reduce_scatter_tensor_out": trained}
    ), reduce_scatters


def _async_case(device: str, fuse_bytes: int) -> None:
    """`issue_async` on a hand-built graph, run for real: three small gathers chained as
    prefetch leaves them (fused into one collective when `fuse_bytes` allows), and two
    reduce-scatters, the first finished before the second starts."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zeroshard.comm import Group
    from zeroshard.compile._graph import refresh_val
    from zeroshard.compile._ops import register_target

    world, rank = dist.get_world_size(), dist.get_rank()
    ops = torch.ops
    stats = zs.EngineStats()
    keys = [register_target(Group(), stats, f"test {i}") for i in range(3)]
    sizes, rs_sizes = [3, 5, 4], [6, 8]
    g = fx.Graph()
    inputs = [g.placeholder(f"in{i}") for i in range(5)]
    # Fake values on the ranks' device: the pass builds the full buffers on it.
    with FakeTensorMode():
        for node, size in zip(inputs, [*sizes, *rs_sizes], strict=True):
            node.meta["val"] = torch.empty(size, device=device)
    full = [
        g.call_function(ops.zeroshard.gather.default, (x, k, world, torch.float32, torch.float32))
        for x, k in zip(inputs, keys, strict=False)
    ]
    outs = [g.call_function(ops.aten.mul.Tensor, (f, 2.0)) for f in full]
    for f, k in zip(full, keys, strict=True):
        g.call_function(ops.zeroshard.release.default, (f, k))
    # The first reduce-scatters a graph input (left as it is), the second a value of the
    # graph's own that nothing else reads (reduced in place).
    own = g.call_function(ops.aten.mul.Tensor, (inputs[4], 1.0))
    rs = [
        g.call_function(ops.zeroshard.reduce_scatter.default, (x, keys[0], world))
        for x in (inputs[3], own)
    ]
    g.output((*outs, *rs))
    for node in [*full, *outs, own, *rs]:
        refresh_val(node)
    zc.issue_async(g, zc.PassContext(zc.Phase.FORWARD, 0, 0, fuse_bytes))
    g.lint()
    index = {n: i for i, n in enumerate(g.nodes)}
    c10d = ops._c10d_functional
    # A gather of its own is in place (see [Note: in-place collectives]), a fused run not.
    starts = [n for n in g.nodes if n.target is c10d.all_gather_into_tensor.default]
    in_place = [n for n in g.nodes if n.target is c10d.all_gather_into_tensor_out.default]
    assert (len(starts), len(in_place)) == ((1, 0) if fuse_bytes else (0, 3))
    # The reduce-scatters' inputs are the graph's own inputs: not overwritten, not in place.
    rs_kinds = (c10d.reduce_scatter_tensor.default, c10d.reduce_scatter_tensor_out.default)
    rs_starts = [n for n in g.nodes if n.target in rs_kinds]
    assert [n.target for n in rs_starts] == list(rs_kinds)
    (first_wait,) = rs_starts[0].users
    assert index[first_wait] < index[rs_starts[1]]
    gm = fx.GraphModule(nn.Module(), g)
    shards = [
        torch.arange(n, dtype=torch.float32) + 10 * rank + 100 * i for i, n in enumerate(sizes)
    ]
    grads = [torch.arange(n, dtype=torch.float32) * (rank + 1) for n in rs_sizes]
    results = gm(*[t.to(device) for t in [*shards, *grads]])
    for i, n in enumerate(sizes):
        every = [torch.arange(n, dtype=torch.float32) + 10 * r + 100 * i for r in range(world)]
        torch.testing.assert_close(results[i].cpu(), 2 * torch.cat(every), rtol=0, atol=0)
    for j, n in enumerate(rs_sizes):
        mean = torch.arange(n, dtype=torch.float32) * sum(range(1, world + 1)) / world
        torch.testing.assert_close(results[3 + j].cpu(), mean.chunk(world)[rank])
    assert (stats.gathers, stats.reduce_scatters, stats.live_bytes) == (3, 2, 0)


def _cases(device: str) -> None:
    cases = [
        {"case": "fp32", "accum": 2, "clip": True},
        # torch.optim.Muon on the hidden matrices, AdamW on the rest (its step is eager).
        {"case": "muon", "accum": 2, "clip": True},
        {"case": "bf16"},
        {"case": "fallback"},
        {"case": "async", "fuse_bytes": 0},
        {"case": "async", "fuse_bytes": 1024},
    ]

    def body(case: str, **kw: Any) -> None:
        if case == "fp32":
            _fp32_case(device, backend="inductor", **kw)
        elif case == "muon":
            _fp32_case(device, backend="aot_eager", make_opt=muon_and_adamw, **kw)
        elif case == "bf16":
            _bf16_case(device)
        elif case == "async":
            _async_case(device, **kw)

        else:
            _fallback_case(device)

    run_each(cases, body)


@pytest.mark.gpu
def test_compiled_parity_recompiles_downcast_fallback(device: str) -> None:
    world_fits(device, 2)
    run_ranks(_cases, 2, device, device=device)
