"""The planned model states equal what the engine really allocates, rank by rank.

World 1-4 on gloo ranks, stages 1-3, with and without offload (and a hybrid run): the
flat layouts, the stage-3 units, and the bytes of parameter buffers, masters (bf16 ones
too), stage-1 grad buffers, AdamW state after a step and the offload host buffers. The
planner calls the engine's own rules (which groups, units, persistence, offload); this
checks the bytes it counts from them, and (world 1) that it counts the prefetch the
engine makes. At 4 ranks a block on process groups of its own (experts, crossing the
hybrid shard groups) is priced by its groups' size (`estimate(..., process_groups=)`).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks
from tests.engine._models import VOCAB, make_model, make_optimizer, muon_and_adamw
from tests.engine.test_plan_tensor_parallel import Allocated
from tests.engine.test_whole_matrix import DeclaredMuon
from tests.engine.test_whole_params_compositions import Factored, factored_and_adamw
from zeroshard.comm import Group
from zeroshard.engine import HomeKind
from zeroshard.engine.planner._estimate import estimate
from zeroshard.engine.planner._groups import plan_groups
from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime.offload import steps_in_blocks

# Small buckets and thresholds so a tiny model still has many groups, units, persistence
# and several offload chunks.
SMALL = {
    "reduce_bucket_bytes": 2048,
    "min_unit_params": 100,
    "persistence_threshold": 1000,
    "offload_chunk_bytes": 1024,
}


def _two_fused(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """make_optimizer's param groups, each in an optimizer of its own (fused: the host
    steps them block by block, as one fused optimizer)."""
    decay, no_decay = make_optimizer(model).param_groups
    return [
        torch.optim.Adam(decay["params"], lr=1e-3, fused=True),
        torch.optim.AdamW(no_decay["params"], lr=1e-3, weight_decay=0.0, fused=True),
    ]


def _optimizers(
    model: torch.nn.Module, muon: bool, several: bool, declared: str
) -> list[torch.optim.Optimizer]:
    if several:
        return _two_fused(model)
    if declared == "factored":
        return factored_and_adamw(model)
    if declared:
        return muon_and_adamw(model, DeclaredMuon)
    return muon_and_adamw(model) if muon else [make_optimizer(model)]


def _case(
    stage: int,
    dtype: str,
    shard: int | None = None,
    muon: bool = False,
    several: bool = False,
    declared: str = "",
    experts: str = "",
    **extra: Any,
) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    # blocks.1 on groups of its own: "pairs" {0, 2} and {1, 3}, crossing the shard groups,
    # or each rank "alone" (every rank makes every group, in one order).
    pairs = [Group(dist.new_group([e, e + 2])) for e in (0, 1)] if experts else []
    alone = [Group(dist.new_group([r])) for r in range(world)] if experts else []
    own = {"blocks.1": pairs[rank % 2] if experts == "pairs" else alone[rank]} if experts else {}
    sizes = {path: g.size for path, g in own.items()}
    cfg = zs.ZeroConfig.from_dict(
        {"stage": stage, "compute_dtype": dtype, "shard_group_size": shard, **SMALL, **extra}
    )
    with torch.device("meta"):
        meta = make_model()
    meta_opts = _optimizers(meta, muon, several, declared)
    pgs = [pg for o in meta_opts for pg in o.param_groups]
    groups_of = {id(p): k for k, pg in enumerate(pgs) for p in pg["params"]}
    # The fused optimizers step in blocks: no group's fp32 upcast (several: every one).
    blocked = not muon and all(steps_in_blocks(o) for o in meta_opts)
    plan = plan_groups(meta, cfg, shard or world, groups_of, blocked, own_sizes=sizes)
    est = estimate(meta, cfg, world, 2, 5, optimizer=meta_opts, process_groups=sizes)

    model = make_model()
    with pytest.MonkeyPatch.context() as patch:
        allocated = Allocated(patch)
        opts = _optimizers(model, muon, several, declared)
        model, opt = zs.initialize(model, opts, cfg, process_groups=own)
        _step(model, opt)
    state = zs.engine_state(model)
    assert [g.layout for g in state.groups] == [g.layout for g in plan.groups]
    assert [g.key for g in state.groups] == [g.key for g in plan.groups]
    host = state.offload

    def offloaded(g: FlatParamGroup) -> bool:
        return host is not None and host.holds(g)

    assert [offloaded(g) for g in state.groups] == [g.home is HomeKind.HOST for g in plan.groups]
    if stage == 3:
        assert state.stage3 is not None
        real_units = [(u.name, u.nbytes, u.persistent) for u in state.stage3.units]
        assert real_units == [(u.name, u.gathered_bytes, u.persistent) for u in plan.units]

    real: dict[str, int] = {"parameters": 0, "master": 0, "optimizer": 0, "grad_buffer": 0}
    for g in state.groups:
        if stage != 3:
            assert g.param_buffer is not None
            real["parameters"] += g.param_buffer.nbytes
        if g.grad_buffer is not None:
            real["grad_buffer"] += g.grad_buffer.nbytes
        if not offloaded(g):
            real["master"] += g.master.nbytes
            real["optimizer"] += sum(t.nbytes for t in opt.state[g.master].values() if t.dim() > 0)
    real["offload_compute"] = 0
    if state.offload is not None:
        real["offload_compute"] = state.offload.nbytes().device
        moved = [g for g in state.groups if offloaded(g)]
        host_opt = sum(t.nbytes for g in moved for t in opt.state[g.master].values() if t.dim())
        # On the CPU nothing is pinned; the same buffers are allocated pageable.
        want_host = state.offload.nbytes().host + host_opt
        assert plan.offload is not None and plan.offload.chunks == state.offload.layout
    else:
        want_host = 0
    owned = torch.zeros(2, dtype=torch.int64)
    if declared:
        # Its state is on the whole parameters at their owners, full-shape: planned as
        # the busiest rank's, on the device or (offloaded groups' matrices) on the host.
        whole = state.whole_params
        assert whole is not None
        for name, p in whole.owned.items():
            kept = sum(
                x.numel() * x.element_size()
                for x in opts[0].state[p].values()
                if isinstance(x, torch.Tensor) and x.dim()
            )
            owned[int(name in whole.on_host)] += kept
        dist.all_reduce(owned, op=dist.ReduceOp.MAX)
        real["optimizer"] += int(owned[0])
        w = est.whole_matrix
        assert w is not None
        # What its step holds beside the buffers: the device's copies of the offloaded
        # groups' gradients and masters, and the state it owns of them, brought up.
        moved = [g for g in state.groups if g.trainable and offloaded(g) and g.key.param_group == 0]
        assert w.held_bytes == 2 * sum(g.master.nbytes for g in moved) + int(owned[1])
        assert (int(owned[1]) > 0 and moved) or host is None
    assert est.host == want_host + int(owned[1]), (est.host, want_host, owned)
    assert dict(est.states) == real, (dict(est.states), real)
    trainable = [g for g in state.groups if g.trainable and not offloaded(g)]
    assert est.grad_shards == sum(g.master.nbytes for g in trainable)
    # Muon's step scratch ([Note: the whole-matrix step's scratch]): the largest update,
    # and the owner buffers and those coming back, as the engine's step allocated them.
    w = est.whole_matrix
    if declared:
        # The whole parameters' exchange (a gradient and a master to the owner, the master
        # back) in the master dtype.
        assert w is not None and w.buffer_bytes > 0 and w.update_bytes == w.joined_bytes == 0
        assert (0, w.buffer_bytes, 0, 0) == allocated.largest()
    if muon:
        # Newton-Schulz's results and iterates too ([Note: Newton-Schulz's memory]).
        assert w is not None and w.buffer_bytes > 0 and w.joined_bytes == 0
        assert w.orthogonalize_bytes > 0
        assert (w.update_bytes, w.buffer_bytes, 0, w.orthogonalize_bytes) == allocated.largest()
        assert est.step_scratch == w.update_bytes + w.buffer_bytes + w.orthogonalize_bytes


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    idx = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    F.cross_entropy(model(idx).flatten(0, 1).float(), idx.flatten()).backward()
    opt.step()
    opt.settle()  # a delayed step allocates the host state on its thread
    opt.zero_grad()


# Every stage, both dtypes and each offload mode on two ranks; at 1, 3 and 4 ranks one
# case per stage (three ranks: padding that 2 and 4 do not need), and hybrid at 4.
CORE: list[dict[str, Any]] = [
    {"stage": 1, "dtype": "bf16"},
    {"stage": 2, "dtype": "bf16", "offload_optimizer": True},
    {"stage": 3, "dtype": "bf16", "offload_optimizer": True, "offload_params": True},
    {"stage": 3, "dtype": "fp32", "offload_optimizer": True, "offload_ratio": 0.4},
]
MUON: dict[str, Any] = {"muon": True, "reduce_bucket_bytes": 2**16, "min_unit_params": 2000}
MORE: list[dict[str, Any]] = [
    {"stage": 2, "dtype": "fp32"},
    {"stage": 3, "dtype": "bf16"},
    {"stage": 1, "dtype": "fp32", "offload_optimizer": True, "offload_ratio": 0.5},
    # bf16 masters: masters, gradient shards and AdamW's state at half the bytes; on the
    # host too.
    {"stage": 1, "dtype": "bf16", "master_dtype": "bf16"},
    {"stage": 3, "dtype": "bf16", "master_dtype": "bf16"},
    {"stage": 2, "dtype": "bf16", "master_dtype": "bf16", "offload_optimizer": True},
    {
        "stage": 3,
        "dtype": "bf16",
        "master_dtype": "bf16",
        "offload_optimizer": True,
        "offload_ratio": 0.5,
    },
    # torch's Muon recipe: its momentum (4 bytes an element) on the device, or on the
    # host, part or all offloaded; its step's scratch on the device either way (groups
    # of several matrices, so that some are cut between the shards and exchanged).
    {"stage": 2, "dtype": "bf16", **MUON},
    {"stage": 3, "dtype": "fp32", **MUON, "offload_optimizer": True, "offload_ratio": 0.5},
    {"stage": 3, "dtype": "bf16", **MUON, "offload_optimizer": True, "offload_params": True},
    # A declared whole-parameter optimizer (Muon's subclass): its exchange in the master
    # dtype, its state full-shape at the owners (bf16 masters: half the bytes).
    {
        "stage": 2,
        "dtype": "bf16",
        "master_dtype": "bf16",
        **MUON,
        "muon": False,
        "declared": "muon",
    },
    {"stage": 3, "dtype": "fp32", **MUON, "muon": False, "declared": "muon"},
    # Offloaded, part of it: its state on the host for the groups offload holds.
    {
        "stage": 2,
        "dtype": "fp32",
        **MUON,
        "muon": False,
        "declared": "muon",
        "offload_optimizer": True,
        "offload_ratio": 0.5,
    },
    # One whose state is not shaped like the matrix (Adafactor's row and column: r + c
    # floats of an r x c matrix), as its step allocates it, on the device and the host.
    {
        "stage": 3,
        "dtype": "fp32",
        **MUON,
        "muon": False,
        "declared": "factored",
        "offload_optimizer": True,
        "offload_ratio": 0.5,
    },
    # Several optimizers, all fused: the host steps each in blocks (delayed, too).
    {"stage": 2, "dtype": "bf16", "offload_optimizer": True, "several": True},
    {
        "stage": 1,
        "dtype": "bf16",
        "offload_optimizer": True,
        "offload_delay_param_update": True,
        "several": True,
    },
]
HYBRID: list[dict[str, Any]] = [
    {"stage": 3, "dtype": "bf16", "shard": 2},
    {"stage": 2, "dtype": "fp32", "shard": 2},
    # A block on groups of their own beside hybrid sharding (experts), offloaded too: its
    # groups of another size than the shard groups.
    {"stage": 3, "dtype": "bf16", "shard": 1, "experts": "pairs"},
    {"stage": 2, "dtype": "fp32", "shard": 2, "experts": "alone", "offload_optimizer": True},
]


def _prefetch_case() -> None:
    """The planner's gathered bytes are the engine's peak, by the engine's own prefetch
    budget: with the next unit prefetched where it fits, and without it where
    max_live_bytes leaves no room for it beside the largest."""
    base = {"stage": 3, "compute_dtype": "fp32", "min_unit_params": 100, "persistence_threshold": 0}
    with torch.device("meta"):
        meta = make_model()
    plan = plan_groups(meta, zs.ZeroConfig.from_dict(base), 1)
    persistent = sum(u.gathered_bytes for u in plan.units if u.persistent)
    moving = sorted((u.gathered_bytes for u in plan.units if not u.persistent), reverse=True)
    assert len(moving) == 2, moving
    for max_live, prefetched in ((2**40, moving[1]), (persistent + sum(moving) - 1, 0)):
        cfg = zs.ZeroConfig.from_dict({**base, "max_live_bytes": max_live})
        est = estimate(meta, cfg, 1, 2, 5, optimizer=make_optimizer(meta))
        assert est.gathered == persistent + moving[0] + prefetched, (max_live, est.gathered)
        model = make_model()
        model, opt = zs.initialize(model, make_optimizer(model), cfg)
        idx = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
        # The first step records the order; the second prefetches along it.
        for _ in range(2):
            F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
            opt.step()
            opt.zero_grad()
        stats = zs.engine_stats(model)
        assert stats.prefetches > 0
        assert stats.peak_live_bytes == est.gathered, (max_live, stats.peak_live_bytes)


def _all_cases() -> None:
    world = dist.get_world_size()
    run_each(CORE + (MORE if world == 2 else []) + (HYBRID if world == 4 else []), _case)
    if world == 1:
        _prefetch_case()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_planned_states_match_the_engine(world_size: int) -> None:
    run_ranks(_all_cases, world_size)


class _ReadsValues(torch.optim.SGD):
    """A declared optimizer whose step reads a value (`.item()`): it cannot step on meta."""

    zeroshard_whole_params = True

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.abs().max().item() > 0:
                    super().step()


class _Counting(Factored):
    """`Factored` that counts its steps in a tensor of its own, in place."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, lr)
        self.steps = torch.zeros((), dtype=torch.int64)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.steps.add_(1)
        super().step()


def test_declared_state_is_what_its_step_allocates() -> None:
    """A declared optimizer's state per whole matrix is measured by a step on meta
    ([Note: a declared optimizer's state, measured]): Adafactor's r + c floats, Muon's
    momentum in the master dtype; the optimizer itself is left as it was (no state, its
    hooks not run). One that cannot step on meta is counted by the runtime's rule."""
    from zeroshard.engine.runtime._owner_state import OwnerState

    params = [torch.nn.Parameter(torch.zeros(3, 4))]
    factored = _Counting(params, lr=0.02)
    muon = DeclaredMuon(params, lr=0.02)
    reads = _ReadsValues(params, lr=0.1, momentum=0.9)

    def refuse(*_: Any) -> None:
        raise AssertionError("a hook ran")

    for o in (factored, muon, reads):
        o.register_step_pre_hook(refuse)
    sizes = OwnerState([factored, muon, reads], torch.float32)
    assert sizes.nbytes(0, (64, 32)) == (64 + 32) * 4
    assert OwnerState([muon], torch.bfloat16).nbytes(0, (64, 32)) == 64 * 32 * 2
    # SGD with momentum by the rule: 1 float an element.
    assert sizes.nbytes(2, (64, 32)) == 64 * 32 * 4
    assert not factored.state and not muon.state and not reads.state
    assert factored.steps.item() == 0  # the probe stepped a copy of its attributes
