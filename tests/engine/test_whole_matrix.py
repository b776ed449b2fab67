"""Whole-matrix optimizers: torch.optim.Muon (and one that declares whole parameters)
with AdamW, passed to `initialize` as torch's two-optimizer recipe, against a plain
single-process run of the same two optimizers on the global batch.

The model is tests/engine/_models.py's OddModel (odd sizes, so matrices cross shard
boundaries at world 3; a frozen layer; the embedding tied to the head, on AdamW). Muon
steps its hidden matrices. Tolerances: fp32 rtol 1e-5 / atol 1e-6 on every parameter;
bf16 and fp16 compute, the parameters' total update within 10% of the reference's in
norm (as test_parity.py). Accumulation runs two micro-batches per step: orthogonalizing
each micro-batch's gradient (DeepSpeed #8443) would miss the fp32 tolerance, and so would
a Muon that is silently off under meta-device init (DeepSpeed #8438).

Checkpoints are saved at world 3 and loaded at world 4 (shard groups of 2, stage 3) and
continue as the reference does; at one shape a resume is bit-identical.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks, subtests
from tests.engine._models import (
    global_batches,
    loss_fn,
    make_model,
    muon_and_adamw,
    parity_atol,
)
from tests.engine.test_meta_init import _fill
from zeroshard.ckpt import consolidate
from zeroshard.comm import Group

STEPS = 3
MICRO = 2
FROZEN = ("frozen.weight", "frozen.bias")


class DeclaredMuon(torch.optim.Muon):
    """A user's own whole-matrix optimizer (Muon's update, so the reference is known),
    stepped on whole parameters at their owners through the declaration."""

    zeroshard_whole_params = True


Make = Callable[[nn.Module], list[torch.optim.Optimizer]]


def _make(kind: str) -> Make:
    return lambda m: muon_and_adamw(m, DeclaredMuon if kind == "declared" else None)


def _config(stage: int, dtype: str = "fp32", **extra: Any) -> dict[str, Any]:
    cfg = {
        "stage": stage,
        "compute_dtype": dtype,
        "reduce_dtype": "fp32",
        # Small groups: matrices cut across groups and shards, several exchanges.
        "reduce_bucket_bytes": 1500,
        **extra,
    }
    if stage == 3:
        cfg.update(min_unit_params=1, persistence_threshold=0)
    return cfg


def _reference(
    model: nn.Module, make: Make, batches: torch.Tensor, steps: range, clip: bool, decay: bool
) -> dict[str, torch.Tensor]:
    """`model` trained in one process on the global batches of `steps` (copied)."""
    ref = copy.deepcopy(model)
    opts = make(ref)
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, 0.5) for o in opts] if decay else []
    for step in steps:
        flat = batches[step].reshape(-1, batches.shape[-1])
        loss_fn(ref, flat).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        for o in opts:
            o.step()
            o.zero_grad()
        for s in scheds:
            s.step()
    return {k: v.detach().clone() for k, v in ref.state_dict().items()}


def _train(
    model: nn.Module,
    opt: zs.ZeroOptimizer,
    batches: torch.Tensor,
    steps: range,
    clip: bool = False,
    sched: Any = None,
) -> None:
    """This rank's part of each global batch, over the accumulation micro-steps."""
    world, rank = dist.get_world_size(), dist.get_rank()
    accum = batches.shape[1]
    for step in steps:
        flat = batches[step].reshape(-1, batches.shape[-1])
        mine = flat.chunk(world)[rank].reshape(accum, -1, flat.shape[-1])
        for micro in mine:
            (loss_fn(model, micro) / accum).backward()
        if clip:
            opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def _compare(
    model: nn.Module, ref: dict[str, torch.Tensor], initial: dict[str, torch.Tensor], dtype: str
) -> None:
    full = zs.full_state_dict(model)
    assert full.keys() == ref.keys()
    for name in FROZEN:
        assert torch.equal(full[name], ref[name]), f"{name}: a frozen parameter moved"
    if dtype == "fp32":
        for name, want in ref.items():
            atol = parity_atol(name, want)
            torch.testing.assert_close(full[name], want, rtol=1e-5, atol=atol, msg=name)
        return
    moved = [k for k in initial if k not in FROZEN and k != "offset"]
    ours = torch.cat([(full[k] - initial[k]).reshape(-1) for k in moved])
    theirs = torch.cat([(ref[k] - initial[k]).reshape(-1) for k in moved])
    err = float((ours - theirs).norm() / theirs.norm())
    assert err < 0.10, f"the update differs from the reference's by {err:.1%}"


def _own_states(opt: zs.ZeroOptimizer) -> None:
    """Each optimizer keeps the state of its own parameters only (the combined optimizer's
    `state` reads through to each one's own, re-pointing none), so its own `state_dict()`
    is what the engine's holds for it."""
    opts = opt.inner.optimizers
    for o, saved in zip(opts, opt.state_dict()["inner"]["optimizers"], strict=True):
        own = {id(p) for pg in o.param_groups for p in pg["params"]}
        assert all(id(p) in own for p in o.state), f"{type(o).__name__} holds others' state"
        assert o.state_dict()["state"].keys() == saved["state"].keys()
    assert all(opt.state[p] is o.state[p] for o in opts for p in o.state)


def _parity_case(stage: int, kind: str, dtype: str, accum: int, clip: bool, decay: bool) -> None:
    world = dist.get_world_size()
    model = make_model(seed=stage + 10 * accum)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    batches = global_batches(STEPS, accum, world, MICRO)
    ref = _reference(model, _make(kind), batches, range(STEPS), clip, decay)
    model, opt = zs.initialize(model, _make(kind)(model), _config(stage, dtype))
    # One scheduler on the returned optimizer covers both optimizers' param groups.
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5) if decay else None
    _train(model, opt, batches, range(STEPS), clip, sched)
    _compare(model, ref, initial, dtype)
    _own_states(opt)
    if kind == "muon":
        # Muon's momentum is sharded as AdamW's moments are: shaped like this rank's shard.
        (muon, _) = opt.inner.optimizers
        for master in (p for pg in muon.param_groups for p in pg["params"]):
            assert opt.state[master]["momentum_buffer"].shape == master.shape


def _fp16_case(stage: int) -> None:
    """An overflow on one rank skips the step everywhere, Muon's momentum included; the
    steps after it train as the reference does on those batches alone."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model(seed=7)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    batches = global_batches(STEPS, 1, world, MICRO)
    ref = _reference(model, _make("muon"), batches, range(1, STEPS), False, False)
    cfg = _config(stage, "fp16", initial_loss_scale=1024.0)
    model, opt = zs.initialize(model, _make("muon")(model), cfg)
    hook = model.l1.weight.register_hook(lambda g: g * float("inf")) if rank == 0 else None
    _train(model, opt, batches, range(1))
    if hook is not None:
        hook.remove()
    assert opt.scaler is not None and opt.scaler.skipped_steps == 1
    assert not any(opt.state.values()), "a skipped step must leave no optimizer state"
    _train(model, opt, batches, range(1, STEPS))
    _compare(model, ref, initial, "fp16")


def _meta_case(kind: str) -> None:
    """Stage 3 on a meta-device model, each unit materialized by `init`: Muon trains it
    bit for bit as the engine trains the same weights built on the CPU. (Not against one
    process at fp32's tolerance: Newton-Schulz's bf16 cast turns a gradient's last-bit
    difference from the ranks' summation order into a different bf16 value now and then,
    which its iterations amplify to a few percent of a matrix's update; seen on an AVX2
    host.)"""
    world = dist.get_world_size()
    cpu_model = make_model(0)
    with torch.no_grad():
        for name, p in cpu_model.named_parameters(remove_duplicate=False):
            _fill(name, p)
    cpu_model.emb.weight.data = cpu_model.head.weight.data
    with torch.device("meta"):
        model = make_model(0)
    model.register_buffer("offset", cpu_model.offset.clone())
    names = {id(m): n for n, m in model.named_modules()}

    def init(module: nn.Module) -> None:
        for pname, p in module.named_parameters(recurse=False):
            prefix = names[id(module)]
            _fill(f"{prefix}.{pname}" if prefix else pname, p)

    batches = global_batches(STEPS, 2, world, MICRO)
    built, built_opt = zs.initialize(cpu_model, _make(kind)(cpu_model), _config(3))
    _train(built, built_opt, batches, range(STEPS), clip=True)
    model, opt = zs.initialize(model, _make(kind)(model), _config(3), param_init=init)
    _train(model, opt, batches, range(STEPS), clip=True)
    want, full = zs.full_state_dict(built), zs.full_state_dict(model)
    assert full.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(full[name], value), f"{name}: differs from the CPU-built run"


# The checkpointed run's global batches: 12 sequences, which 3 and 4 ranks split evenly.
def _checkpointed_batches() -> torch.Tensor:
    return global_batches(4, 1, 3, 4)


def _checkpoint_case(root: str, kind: str) -> None:
    """Saved after step 1 at stage 2; a fresh engine loads it and its steps 2 and 3 are
    the bits of the run that went on. The directory is loaded at world 4 after."""
    batches = _checkpointed_batches()
    model = make_model(seed=4)
    model, opt = zs.initialize(model, _make(kind)(model), _config(2))
    _train(model, opt, batches, range(2), clip=True)
    zs.save_checkpoint(model, opt, Path(root) / kind, step=2)
    at_save = zs.full_state_dict(model)
    if dist.get_rank() == 0:
        # Consolidation needs no optimizer: the weights are those the ranks hold.
        out = Path(root) / f"{kind}.safetensors"
        consolidate(Path(root) / kind, out)
        for name, value in load_file(str(out)).items():
            assert torch.equal(value, at_save[name]), f"{name}: consolidated differs"
    # The optimizer's own state dict (same world size) round-trips both optimizers too.
    saved = copy.deepcopy(opt.state_dict())
    _train(model, opt, batches, range(2, 4), clip=True)
    went_on = zs.full_state_dict(model)
    again = make_model(seed=5)
    again, opt2 = zs.initialize(again, _make(kind)(again), _config(2))
    zs.load_checkpoint(again, opt2, Path(root) / kind)
    _own_states(opt2)
    _train(again, opt2, batches, range(2, 4), clip=True)
    resumed = zs.full_state_dict(again)
    for name, value in went_on.items():
        assert torch.equal(resumed[name], value), f"{name}: the resume is not bit-identical"
    opt2.load_state_dict(saved)
    _train(again, opt2, batches, range(2, 4), clip=True)
    for name, value in zs.full_state_dict(again).items():
        assert torch.equal(went_on[name], value), f"{name}: state_dict() round trip"


def _world3(root: str) -> None:
    cases = subtests({"stage": [1, 2, 3], "kind": ["muon"], "dtype": ["fp32"], "accum": [2]})
    cases = [dict(c, clip=c["stage"] != 2, decay=c["stage"] == 1) for c in cases]
    cases += [
        dict(stage=s, kind="declared", dtype="fp32", accum=2, clip=True, decay=False)
        for s in (2, 3)
    ]
    cases += [
        dict(stage=s, kind="muon", dtype="bf16", accum=1, clip=True, decay=False) for s in (2, 3)
    ]
    run_each(cases, _parity_case)
    run_each([{"stage": 2}], _fp16_case)
    run_each([{"kind": "muon"}, {"kind": "declared"}], _meta_case)
    run_each([{"kind": "muon"}, {"kind": "declared"}], lambda kind: _checkpoint_case(root, kind))


def _world4(root: str) -> None:
    """Hybrid sharding (shard groups of 2) at stages 2 and 3; the world-3 checkpoints
    loaded into it at stage 3; Muon on a parameter with a process group of its own (an
    expert's); a declared optimizer there refused."""
    world, rank = dist.get_world_size(), dist.get_rank()

    def hybrid(stage: int) -> None:
        model = make_model(seed=stage)
        batches = global_batches(STEPS, 1, world, MICRO)
        ref = _reference(model, _make("muon"), batches, range(STEPS), True, False)
        cfg = _config(stage, shard_group_size=2)
        model, opt = zs.initialize(model, _make("muon")(model), cfg)
        _train(model, opt, batches, range(STEPS), clip=True)
        _compare(model, ref, {}, "fp32")

    def resharded(kind: str) -> None:
        # Steps 0 and 1 of the world-3 run, then steps 2 and 3 here, on its global batches.
        saved = _checkpointed_batches()
        ref = _reference(make_model(seed=4), _make(kind), saved, range(4), True, False)
        model = make_model(seed=6)
        model, opt = zs.initialize(model, _make(kind)(model), _config(3, shard_group_size=2))
        assert zs.load_checkpoint(model, opt, Path(root) / kind) == 2
        _train(model, opt, saved, range(2, 4), clip=True)
        _compare(model, ref, {}, "fp32")

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    own = Group(pairs[rank // 2])

    def experts(stage: int) -> None:
        # l1 data-parallel over a pair of ranks (as experts are), its matrix owned by one
        # rank of the pair. Every rank trains on the same batch, so the pairs' average is
        # the world's and the reference is one process on that batch.
        model = make_model(seed=8)
        batches = global_batches(STEPS, 1, 1, MICRO)
        ref = _reference(model, _make("muon"), batches, range(STEPS), False, False)
        cfg = _config(stage)
        model, opt = zs.initialize(model, _make("muon")(model), cfg, process_groups={"l1": own})
        for step in range(STEPS):
            loss_fn(model, batches[step].reshape(-1, batches.shape[-1])).backward()
            opt.step()
            opt.zero_grad()
        _compare(model, ref, {}, "fp32")

    run_each([{"stage": 2}, {"stage": 3}], hybrid)
    run_each([{"kind": "muon"}, {"kind": "declared"}], resharded)
    run_each([{"stage": 2}, {"stage": 3}], experts)
    model = make_model(seed=1)
    with pytest.raises(ValueError, match=r"DeclaredMuon steps whole parameters by name"):
        zs.initialize(model, _make("declared")(model), _config(2), process_groups={"l1": own})


def test_muon_and_adamw_match_one_process(tmp_path: Path) -> None:
    """Stages 1-3, the declared optimizer, bf16, fp16 with an overflow, meta-device init,
    accumulation, clipping, one LR scheduler for both, frozen and tied parameters, on 3
    ranks; hybrid sharding and checkpoints resharded to 4 ranks and stage 3."""
    run_ranks(_world3, 3, str(tmp_path))
    run_ranks(_world4, 4, str(tmp_path))


def _refusals() -> None:
    model = make_model(seed=1)
    muon, adamw = _make("muon")(model)
    # The parameter by its name in the model (it was "a parameter of shape (8, 8)").
    both = r"^l1.weight is in optimizer 0 \(Muon\) and in optimizer 1 \(AdamW\)"
    with pytest.raises(ValueError, match=both):
        zs.initialize(model, [muon, torch.optim.AdamW(model.parameters())], _config(2))
    # The parameters where the optimizer goes (it said "optimizer 0 is a Parameter").
    with pytest.raises(TypeError, match=r"takes the optimizer built on them: pass torch.optim"):
        zs.initialize(model, model.parameters(), _config(2))  # type: ignore[arg-type]
    # Several optimizers step delayed where each is one the delayed step snapshots.
    with pytest.raises(ValueError, match=r"delay_param_update .*fused=True.*got SGD"):
        sgd = torch.optim.SGD(muon.param_groups[0]["params"], lr=0.1)
        delayed = _config(2, offload_optimizer=True, offload_delay_param_update=True)
        zs.initialize(model, [sgd, adamw], delayed)


def test_bad_optimizer_sets_are_refused() -> None:
    run_ranks(_refusals, 1)
