"""Experts on process groups of their own beside hybrid sharding and tensor parallelism.

The semantics are test_expert_groups.py's: each expert is sharded over, and its gradients
averaged over, the ranks that hold it (its group of its own); everything else over the
data-parallel ranks. The single-process reference holds the trunk and every expert,
trains on the global batch (each data-parallel rank's batch seen by that rank's expert)
and scales each expert's gradient by (data-parallel ranks) / (its group's size), DDP's
average over that group; torch's `clip_grad_norm_` clips over all of it, each parameter
once.

- Hybrid sharding: 4 ranks, `shard_group_size` 2 (shard groups {0, 1} and {2, 3}), expert
  e on ranks {e, e + 2}: its group crosses the shard groups (torchtitan shards experts
  over the ranks that hold them, the rest over dp_shard). At stage 3 the experts'
  summed gradients are divided by `gradient_divide_factor` 1 instead (the reference's
  scale: data-parallel ranks / 1), never averaged over the replicas. In fp16 an
  overflow in one rank's expert shard skips the step everywhere; a snapshot in memory
  restores; ranks that disagree on a group are refused.
- Tensor parallelism: 4 ranks, a 2-D mesh (dp 2 x tp 2) or a 3-D one (dp_replicate 2 x
  dp_shard 1 x tp 2); each expert's Linears split over tp (column-, then row-wise); its
  group the data-parallel ranks of one tp coordinate that hold it: one rank each
  ("alone": two experts), or both ("shared": one); on the 3-D mesh under
  `zeroshard.compile` too, there with `gradient_divide_factor` 4.

Each case trains 3 steps with clipping against the reference, saves after the second,
and a fresh engine that loads that checkpoint repeats the third step bit for bit.
The hybrid checkpoint loads at 2 ranks without hybrid sharding and consolidates, each
expert as its ranks held it; the tp checkpoints consolidate each expert whole, its tp
pieces joined (loads at another tp size: test_expert_tensor_parallel_state.py). Groups
that cross tensor-parallel coordinates, or differ from their tp peers', are refused with
a clear error on every rank.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

import zeroshard.compile as zc
import zeroshard.engine as zs
from tests._dist import run_each, run_ranks
from tests.engine._models import global_batches
from tests.engine.test_expert_groups import Trunk, _loss
from zeroshard.ckpt import CheckpointError, consolidate
from zeroshard.comm import Group

D = 12
MAX_NORM = 0.5
STEPS = 3


def _trunk(expert_seed: int) -> Trunk:
    """test_expert_groups.py's model at this file's sizes."""
    return Trunk(expert_seed, D, hidden=2)


class Reference:
    """The trunk and every expert in one process, stepped on the global batch."""

    def __init__(self, experts: int, scale: float) -> None:
        self.model = _trunk(0)
        self.experts = [copy.deepcopy(_trunk(i).expert) for i in range(experts)]
        self.params = [
            *self.model.emb.parameters(),
            *self.model.head.parameters(),
            *(p for e in self.experts for p in e.parameters()),
        ]
        self.opt = torch.optim.SGD(self.params, lr=0.1, momentum=0.9)
        self.scale = scale

    def step(self, batches: torch.Tensor, expert_of: list[int]) -> torch.Tensor:
        """One step on `batches[d]` for each data-parallel rank d, whose expert is
        `expert_of[d]`; the clip norm."""
        n = len(expert_of)
        loss = sum(_loss(self.model, batches[d], self.experts[e]) for d, e in enumerate(expert_of))
        (loss / n).backward()
        for e in self.experts:
            for p in e.parameters():
                if p.grad is not None:
                    p.grad.mul_(self.scale)  # averaged over its group, not every dp rank
        norm = torch.nn.utils.clip_grad_norm_(self.params, MAX_NORM)
        self.opt.step()
        self.opt.zero_grad()
        return norm

    def full(self, expert: int) -> dict[str, torch.Tensor]:
        """What one rank's full state dict should hold: the trunk and its expert."""
        sd = {k: v for k, v in self.model.state_dict().items() if not k.startswith("expert.")}
        sd.update({f"expert.{k}": v for k, v in self.experts[expert].state_dict().items()})
        return sd


def _config(stage: int, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"stage": stage, "reduce_bucket_bytes": 800, **extra}
    if stage == 3:
        cfg.update(unit_modules=["expert"], min_unit_params=1, persistence_threshold=0)
    return cfg


def _step(model: nn.Module, zopt: zs.ZeroOptimizer, batch: torch.Tensor) -> torch.Tensor:
    _loss(model, batch).backward()
    norm = zopt.clip_grad_norm_(MAX_NORM)
    zopt.step()
    zopt.zero_grad()
    return norm


def _train_save_resume(
    build: Any, batch_of: int, expert: int, expert_of: list[int], scale: float, root: str
) -> None:
    """Train `build()`'s engine against the reference, save after step 2 (with each
    rank's full state dict beside it), then check that an engine built afresh and loaded
    repeats step 3 bit for bit."""
    batches = global_batches(STEPS, 1, len(expert_of), 2)[:, 0]
    model, zopt = build(expert)
    ref = Reference(max(expert_of) + 1, scale)
    for step in range(STEPS):
        if step == STEPS - 1:
            zs.save_checkpoint(model, zopt, root, step=step)
            torch.save(zs.full_state_dict(model), f"{root}-rank{dist.get_rank()}.pt")
        norm = _step(model, zopt, batches[step, batch_of])
        want = ref.step(batches[step], expert_of)
        assert want > MAX_NORM  # the clipping bites
        torch.testing.assert_close(norm, want, rtol=1e-5, atol=0)
        full = zs.full_state_dict(model)
        for name, value in ref.full(expert).items():
            torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6, msg=name)
    model2, zopt2 = build(expert + 7)  # other weights: the load must replace them all
    assert zs.load_checkpoint(model2, zopt2, root) == STEPS - 1
    again = _step(model2, zopt2, batches[STEPS - 1, batch_of])
    assert torch.equal(again, norm)
    full2 = zs.full_state_dict(model2)
    assert full2.keys() == full.keys()
    for name, value in full.items():
        assert torch.equal(full2[name], value), name


# -- hybrid sharding -----------------------------------------------------------------------


def _hybrid_case(pairs: dict[int, Group], stage: int, root: str, factor: int | None) -> None:
    rank = dist.get_rank()
    where = f"{root}/hybrid-s{stage}"

    def build(seed: int) -> tuple[nn.Module, zs.ZeroOptimizer]:
        model = _trunk(seed)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        cfg = _config(stage, shard_group_size=2)
        return zs.initialize(
            model,
            opt,
            cfg,
            process_groups={"expert": pairs[rank % 2]},
            gradient_divide_factor=factor,
        )

    # The experts' gradients summed over their pair, divided by 2 or the factor.
    _train_save_resume(build, rank, rank % 2, [0, 1, 0, 1], 4 / (factor or 2), where)
    # Each expert once (its pair's files), everything else once (the first replica's).
    _check_saved_once(Path(where) / f"step-{STEPS - 1}")


def _check_saved_once(step: Path) -> None:
    meta = json.loads((step / "metadata.json").read_text())
    assert meta["version"] == 7 and meta["world_size"] == 4
    files = {r: set(safe_open(step / f"rank{r:05d}.safetensors", "pt").keys()) for r in range(4)}
    for g in meta["groups"]:
        expert = g["layout"]["slots"][0][0].startswith("expert.")
        assert g["rank_sets"] == ([[0, 2], [1, 3]] if expert else [[0, 1]]), g["name"]
        holders = {r for r, keys in files.items() if f"{g['name']}.master" in keys}
        assert holders == ({0, 1, 2, 3} if expert else {0, 1}), g["name"]


def _hybrid_overflow(pairs: dict[int, Group]) -> None:
    """fp16: an overflow in an expert's shard on one rank of the second replica alone
    (after the reduce-scatter, in rank 3's half of expert 1) skips the step on every
    rank, those of the other shard group too."""
    rank = dist.get_rank()
    model = _trunk(rank % 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = _config(2, shard_group_size=2, compute_dtype="fp16", initial_loss_scale=1024.0)
    model, zopt = zs.initialize(model, opt, cfg, process_groups={"expert": pairs[rank % 2]})
    # A slot of the expert's with elements in the pair's second rank's shard (2, or 3).
    name, a, b = next(
        (slot.name, max(lo, slot.offset) - slot.offset, min(hi, slot.end) - slot.offset)
        for g in zs.engine_state(model).groups
        if g.names[0].startswith("expert.")
        for lo, hi in [g.layout.shard_range(1)]
        for slot in g.layout.slots
        if max(lo, slot.offset) < min(hi, slot.end)
    )

    def poison(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[a:b] = float("inf")
        return grad

    if rank == 3:
        model.get_parameter(name).register_hook(poison)
    before = {k: v.clone() for k, v in zs.full_state_dict(model).items()}
    batch = global_batches(1, 1, 4, 2)[0, 0, rank]
    _loss(model, batch).backward()
    assert not torch.isfinite(zopt.clip_grad_norm_(MAX_NORM)), "every rank sees it"
    zopt.step()
    zopt.zero_grad()
    assert zopt.scaler is not None and zopt.scaler.skipped_steps == 1
    after = zs.full_state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before), "nothing stepped"


class WholeSGD(torch.optim.SGD):
    """SGD stepped on whole parameters at their owners, through the declaration."""

    zeroshard_whole_params = True


def _hybrid_snapshot(pairs: dict[int, Group], root: str, declared: bool) -> None:
    """A snapshot in memory holds every rank's shards, the replicas' too (which do not
    write the first replica's groups to disk): restored, the step after it repeats. With
    the trunk's matrices on an optimizer that declares whole parameters, the state each
    replica's owners keep of them too."""
    rank = dist.get_rank()
    model = _trunk(rank % 2)
    opts: list[torch.optim.Optimizer] = [torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)]
    if declared:
        trunk = [model.emb.weight, model.head.weight]
        rest = [p for p in model.parameters() if all(p is not t for t in trunk)]
        opts = [WholeSGD(trunk, lr=0.1, momentum=0.9), torch.optim.SGD(rest, lr=0.1, momentum=0.9)]
    cfg = _config(3, shard_group_size=2)
    model, zopt = zs.initialize(model, opts, cfg, process_groups={"expert": pairs[rank % 2]})
    batches = global_batches(2, 1, 4, 2)[:, 0, rank]
    snaps = zs.Snapshots(model, zopt, every=1, root=f"{root}/shm{int(declared)}")
    try:
        _step(model, zopt, batches[0])
        snaps.take(1)
        saved = zs.full_state_dict(model)
        norm = _step(model, zopt, batches[1])
        after = zs.full_state_dict(model)
        assert snaps.resume(f"{root}/snap-ckpt{int(declared)}") == 1
        assert all(torch.equal(v, saved[k]) for k, v in zs.full_state_dict(model).items())
        assert torch.equal(_step(model, zopt, batches[1]), norm)
        assert all(torch.equal(v, after[k]) for k, v in zs.full_state_dict(model).items())
    finally:
        snaps.close()


def _hybrid_refused(pairs: dict[int, Group]) -> None:
    """Ranks that disagree on a group (rank 0 passes {0, 2}, rank 2 passes {2, 3}) are
    refused on every rank, before a collective of it waits for a rank that never joins."""
    rank = dist.get_rank()
    other = Group(dist.new_group([2, 3]))
    mine = pairs[rank] if rank < 2 else other
    model = _trunk(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"rank 0 holds ranks \[0, 2\], but rank 2 passes"):
        zs.initialize(model, opt, _config(2, shard_group_size=2), process_groups={"expert": mine})


def _hybrid(root: str) -> None:
    pairs = {e: Group(dist.new_group([e, e + 2])) for e in (0, 1)}
    run_each([{}], lambda: _hybrid_refused(pairs))
    cases = [{"stage": 2, "factor": None}, {"stage": 3, "factor": 1}]
    run_each(cases, lambda stage, factor: _hybrid_case(pairs, stage, root, factor))
    run_each([{}], lambda: _hybrid_overflow(pairs))
    run_each(
        [{"declared": False}, {"declared": True}],
        lambda declared: _hybrid_snapshot(pairs, root, declared),
    )


def _hybrid_loads_at_world_2(root: str) -> None:
    """The hybrid checkpoint at 2 ranks without hybrid sharding, each expert alone on its
    rank: the weights each rank held at the save, bit for bit."""
    rank = dist.get_rank()
    alone = [Group(dist.new_group([r])) for r in range(2)]
    model = _trunk(rank + 7)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, zopt = zs.initialize(model, opt, _config(3), process_groups={"expert": alone[rank]})
    assert zs.load_checkpoint(model, zopt, f"{root}/hybrid-s3") == STEPS - 1
    want = torch.load(f"{root}/hybrid-s3-rank{rank}.pt")  # rank r held expert r
    got = zs.full_state_dict(model)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_experts_with_hybrid_sharding(tmp_path: Path) -> None:
    run_ranks(_hybrid, 4, str(tmp_path))
    run_ranks(_hybrid_loads_at_world_2, 2, str(tmp_path))
    # Consolidated one expert at a time, from the files of every replica: instance k is
    # what rank k held (ranks 0 and 1 hold experts 0 and 1).
    step = tmp_path / "hybrid-s3" / f"step-{STEPS - 1}"
    for k in (0, 1):
        out = tmp_path / f"instance{k}.safetensors"
        consolidate(step, out, instance=k)
        got, want = load_file(out), torch.load(tmp_path / f"hybrid-s3-rank{k}.pt")
        assert got.keys() == want.keys()
        for name, value in got.items():
            assert torch.equal(value, want[name]), name


# -- tensor parallelism --------------------------------------------------------------------


def _tp_case(
    groups: dict[tuple[int, ...], Group],
    dims: int,
    layout: str,
    root: str,
    compiled: bool,
    factor: int | None = None,
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    rank = dist.get_rank()
    if dims == 2:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    else:
        mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    dp, tp = divmod(rank, 2)
    alone = layout == "alone"
    expert = dp if alone else 0
    mine = groups[(rank,) if alone else (tp, tp + 2)]

    def build(seed: int) -> tuple[Any, zs.ZeroOptimizer]:
        model = _trunk(seed)
        parallelize_module(
            model.expert, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()}
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, zopt = zs.initialize(
            model,
            opt,
            _config(3),
            process_groups={"expert": mine},
            gradient_divide_factor=factor,
            device_mesh=mesh,
        )
        # The engine's functions take zeroshard.compile's wrapper for the model.
        return (zc.compile(model, backend="aot_eager") if compiled else model), zopt

    expert_of = [0, 1] if alone else [0, 0]
    where = f"{root}/tp{dims}-{layout}{'-compiled' if compiled else ''}"
    # The experts' gradients summed over their group, divided by its size or the factor.
    divisor = factor or (1 if alone else 2)
    _train_save_resume(build, dp, expert, expert_of, 2 / divisor, where)


def _tp_refused(groups: dict[tuple[int, ...], Group]) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = rank // 2
    bad = {
        "cross tensor-parallel coordinates": (2 * dp, 2 * dp + 1),  # its tp group
        "its tensor-parallel peer": {0: (0,), 1: (1, 3), 2: (2,), 3: (1, 3)}[rank],
    }
    for why, ranks in bad.items():
        with pytest.raises(ValueError, match=why):
            model = _trunk(0)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            zs.initialize(
                model, opt, {"stage": 2}, process_groups={"expert": groups[ranks]}, device_mesh=mesh
            )


def _tensor_parallel(root: str) -> None:
    sets = [(0,), (1,), (2,), (3,), (0, 2), (1, 3), (0, 1), (2, 3)]
    groups = {s: Group(dist.new_group(list(s))) for s in sets}  # every rank, in one order
    cases = [
        {"dims": 2, "layout": "alone", "compiled": False},
        {"dims": 2, "layout": "shared", "compiled": False},
        {"dims": 3, "layout": "alone", "compiled": False},
        # zeroshard.compile averages the 3-D mesh's replicas as eager does (it did not),
        # and divides the experts' gradients by the factor.
        {"dims": 3, "layout": "alone", "compiled": True, "factor": 4},
    ]
    run_each(cases, lambda **case: _tp_case(groups, root=root, **case))
    run_each([{}], lambda: _tp_refused(groups))


def test_experts_with_tensor_parallelism(tmp_path: Path) -> None:
    run_ranks(_tensor_parallel, 4, str(tmp_path))
    # Each expert consolidated whole, its tp pieces joined: bit for bit the full state
    # dict of a rank holding it at the save (rank 2k holds expert k where each rank has
    # its own; every rank the one expert where the tp peers share it).
    for layout, experts in [("tp2-alone", 2), ("tp3-alone", 2), ("tp2-shared", 1)]:
        for k in range(experts):
            out = tmp_path / f"{layout}-expert{k}.safetensors"
            consolidate(tmp_path / layout, out, instance=k if experts > 1 else None)
            got, want = load_file(out), torch.load(tmp_path / f"{layout}-rank{2 * k}.pt")
            assert got.keys() == want.keys()
            for name, value in want.items():
                assert torch.equal(got[name], value), f"{layout} expert {k}: {name}"
    with pytest.raises(CheckpointError, match="instance 2 out of range"):
        consolidate(tmp_path / "tp2-alone", tmp_path / "out.safetensors", instance=2)


# -- the planner ---------------------------------------------------------------------------


def test_planner_prices_experts_memory_only() -> None:
    """`estimate(..., process_groups=)` shards an expert over its group's size (the bytes
    are checked against real engines in test_estimate_states.py); what it does not model
    it refuses by name."""
    with torch.device("meta"):
        model = _trunk(0)
    cfg = _config(3, shard_group_size=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    alone, pairs = (
        zs.estimate(model, cfg, 4, 2, 5, optimizer=opt, process_groups={"expert": n})
        for n in (1, 2)
    )
    expert = sum(p.numel() for p in model.expert.parameters())
    # Master and momentum (fp32) of the expert's half that a pair lets go of.
    assert alone.states["master"] - pairs.states["master"] == pytest.approx(4 * expert / 2, abs=64)
    with pytest.raises(ValueError, match="prices memory only"):
        zs.estimate(
            model, cfg, 4, 2, 5, compute=zs.Compute(step_s=0.1), process_groups={"expert": 2}
        )
    with pytest.raises(ValueError, match="holds 1 to world_size"):
        zs.estimate(model, cfg, 4, 2, 5, process_groups={"expert": 8})
