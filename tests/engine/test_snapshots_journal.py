"""The gradient journal (Snapshots(every=1, full_every=K): [Note: the gradient journal] in
zeroshard/engine/recovery/_journal.py) on 2 gloo ranks, each its own "node": a restore at
a step between two full snapshots loads the full one and replays the entries after it,
ending where the uninterrupted run was, bit for bit (masters, optimizer state, learning
rate, the user's state), and the steps after it repeat that run's losses. The steps clip
(the norm is above the limit at every step, so each step's coefficient matters) and a
scheduler changes the learning rate at every step. A damaged entry makes the restore
stop at the newest step the intact files reach, with one warning saying how many steps
that costs."""

from __future__ import annotations

import os
import random
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks, seeded
from tests.engine._models import (
    global_batches,
    loss_fn,
    make_model,
    make_optimizer,
    muon_and_adamw,
)
from tests.engine.test_snapshots import _state
from tests.engine.test_whole_params_compositions import factored_and_adamw
from zeroshard.engine.recovery import Snapshots
from zeroshard.engine.recovery._file import mapped, parse
from zeroshard.engine.recovery._places import RUN_ID
from zeroshard.engine.recovery._store import ENTRY, ENTRY_REPLICA, OWN, REPLICA

STEPS = 7  # full snapshots at 1 and 5, entries at 2-4 and 6-7 (full_every=4)
MAX_NORM = 0.05


def _optimizers(model: torch.nn.Module, kind: str) -> list[torch.optim.Optimizer]:
    """`kind` "sgd+adamw": SGD with momentum on the matrices, AdamW on the rest (several
    optimizers, each stepping its own flat groups); "muon": torch's Muon on the hidden
    matrices, AdamW on the rest; "factored": a user's whole-matrix optimizer (declaring
    `zeroshard_whole_params`) on the matrices, AdamW on the rest; else make_optimizer's."""
    if kind == "muon":
        return muon_and_adamw(model)
    if kind == "factored":
        return factored_and_adamw(model)
    if kind == "fused":  # make_optimizer's AdamW, fused: what the delayed step takes
        groups = [
            {"params": g["params"], "weight_decay": g["weight_decay"]}
            for g in make_optimizer(model).param_groups
        ]
        return [torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), fused=True)]
    if kind != "sgd+adamw":
        return [make_optimizer(model, kind)]
    matrices = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [
        torch.optim.SGD(matrices, lr=0.05, momentum=0.9),
        torch.optim.AdamW(rest, lr=1e-3, betas=(0.9, 0.95), foreach=True),
    ]


def _build(
    stage: int, kind: str, extra: dict[str, object] | None = None
) -> tuple[torch.nn.Module, zs.ZeroOptimizer, object]:
    model = make_model(11)
    config = {"stage": stage, "min_unit_params": 1, **(extra or {})}
    model, opt = zs.initialize(model, _optimizers(model, kind), config)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _journaled(
    stage: int, kind: str, extra: dict[str, object] | None, root: str
) -> tuple[torch.nn.Module, zs.ZeroOptimizer, Any, dict[str, int], Snapshots]:
    """`_build`'s engine journaled (full_every=4) with the scheduler and the data position
    as global state and an RNG as each rank's: model, optimizer, scheduler, data, snapshots."""
    model, opt, sched = _build(stage, kind, extra)
    data = {"next_step": 0}
    client = {"sched": sched, "data": data}
    mine = {"rng": zs.RNGState()}
    snaps = Snapshots(
        model, opt, every=1, full_every=4, client_state=client, rank_state=mine, root=root
    )
    return model, opt, sched, data, snaps


def _step(
    model: torch.nn.Module, opt: zs.ZeroOptimizer, sched: object, step: int, schedule: str = ""
) -> float:
    """One step; `schedule` "step_in_backward": the offloaded groups stepped in backward
    (no clipping: refused there)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = global_batches(12, 1, 12, 1)[step, 0]
    x = batch.reshape(world, -1, batch.shape[-1])[rank]
    noise = torch.rand(())  # an RNG draw per step: the restored RNG must give it again
    loss = loss_fn(model, x) * (1 + 0.01 * noise)
    if schedule == "step_in_backward":
        with opt.step_in_backward():
            loss.backward()
    else:
        loss.backward()
        norm = opt.clip_grad_norm_(MAX_NORM)
        assert norm > MAX_NORM  # clipped: the journal must hold the clipped gradient
    opt.step()
    opt.zero_grad()
    sched.step()  # type: ignore[attr-defined]
    return float(loss.detach())


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def _journal(
    folder: str,
    stage: int,
    kind: str,
    extra: dict[str, object],
    damage: bool,
    schedule: str = "",
) -> None:
    root, disk = f"{folder}/shm", f"{folder}/ckpt"
    rank = dist.get_rank()
    torch.manual_seed(7 + rank)
    random.seed(rank)
    model, opt, sched, data, snaps = _journaled(stage, kind, extra, root)
    try:
        assert snaps.resume(disk) is None
        states, losses = {}, {}
        for s in range(STEPS + 2):
            losses[s] = _step(model, opt, sched, s, schedule)
            data["next_step"] = s + 1
            states[s + 1] = _state(model, opt)
            if s < STEPS:
                assert snaps.take(s + 1)
            if s == STEPS - 1:
                snaps.wait()
                # Step 5's full snapshot and the entries after it; step 1's and its
                # entries dropped once 5 was complete.
                held = {(h.step, h.rank, h.kind) for h in snaps.store.held()}
                pairs = ((rank, ENTRY), (1 - rank, ENTRY_REPLICA))
                entries = {(s, r, k) for s in (6, 7) for r, k in pairs}
                assert held == {(5, rank, OWN), (5, 1 - rank, REPLICA), *entries}, held
                # The peer's entries are kept in a ring of K slots as the rank's own are
                # (5 entries so far: the one of step 7 in the slot of step 2's), each
                # linked in under its step's name.
                ring = list((snaps.store.folder / "slots").glob(f"rank{rank:05d}-*-replica*"))
                assert len(ring) == 4, ring
                assert snaps.store.path(7, 1 - rank, 2, ENTRY_REPLICA).stat().st_nlink == 2
                # The planner's count of an entry is its gradient shards (less its header,
                # padded to 64 KiB, and the buffers and user state).
                with seeded(0), torch.device("meta"):  # the run's RNG left as it was
                    planned = zs.estimate(make_model(11), {"stage": stage, **extra}, 2, 1, 4)
                size = snaps.store.path(7, rank, 2, ENTRY).stat().st_size
                if not extra.get("offload_optimizer"):  # (its gradients are on the host)
                    grads = planned.grad_shards
                    assert grads < size < grads + 80 * 1024, (size, grads)
        if damage:
            # Both copies of rank 1's entry of step 6: only step 5 is covered.
            for k in (ENTRY, ENTRY_REPLICA):
                path = snaps.store.path(6, 1, 2, k)
                if path.exists():
                    data_ = bytearray(path.read_bytes())
                    data_[len(data_) // 2] ^= 0x10
                    path.write_bytes(data_)
        dist.barrier()
        snaps.client_state["data"] = {"next_step": -1}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = snaps.resume(disk)
        texts = [str(w.message) for w in caught if "resume" in str(w.message)]
        want = 5 if damage else STEPS
        assert step == want and snaps.last_resume.source == "memory"
        assert snaps.client_state["data"] == {"next_step": want}
        if rank == 0:
            if damage:
                assert len(texts) == 1 and "crc32c is" in texts[0], texts
                assert "2 step(s) behind the newest snapshot (step 7)" in texts[0], texts
            else:
                assert texts == []
        _equal(_state(model, opt), states[want])
        # The steps after it are the uninterrupted run's; the journal goes on from the
        # full snapshot restored (step 5): the next take is an entry.
        for s in range(want, STEPS + 2):
            assert _step(model, opt, sched, s, schedule) == losses[s], s
            data["next_step"] = s + 1
            _equal(_state(model, opt), states[s + 1])
            if s == want:
                snaps.take(s + 1)
        snaps.wait()
        held = {(h.step, h.kind) for h in snaps.store.held() if h.rank == rank}
        assert held == {(5, OWN), *((s, ENTRY) for s in range(6, want + 2))}, held
    finally:
        snaps.close()
    assert not snaps.store.folder.exists()


def _falls_back_to_full(folder: str) -> None:
    """A step whose gradients were written after it (zeroed in place before `take`), or
    two optimizer steps between takes, gets a full snapshot, one warning saying why."""
    model, opt, _ = _build(2, "adamw")
    snaps = Snapshots(model, opt, every=1, full_every=4, root=folder)
    rank = dist.get_rank()
    try:
        kinds, warned = {}, {}
        for s in range(4):
            batch = global_batches(12, 1, 12, 1)[s, 0]
            loss_fn(model, batch.reshape(2, -1, batch.shape[-1])[rank]).backward()
            opt.step()
            if s == 3:
                opt.step()  # a second step without its own take
            opt.zero_grad(set_to_none=s != 2)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                snaps.take(s + 1)
            snaps.wait()
            kinds[s + 1] = {h.kind for h in snaps.store.held() if h.step == s + 1}
            warned[s + 1] = [str(w.message) for w in caught if "in full" in str(w.message)]
        assert kinds == {
            1: {OWN, REPLICA},
            2: {ENTRY, ENTRY_REPLICA},
            3: {OWN, REPLICA},
            4: {OWN, REPLICA},
        }, kinds
        if rank == 0:
            assert warned[1] == warned[2] == [], warned
            assert len(warned[3]) == 1 and "written after the step" in warned[3][0], warned
            assert len(warned[4]) == 1 and "2 optimizer step(s)" in warned[4][0], warned
    finally:
        snaps.close()


def _nodes_lost_in_turn(folder: str) -> None:
    """Rank 1's node loses its memory between two full snapshots (its snapshots dropped, as
    a node replaced comes up empty): the restore fetches its full snapshot and entries
    from the replicas rank 0 keeps, replays them, and puts them back in place, replicated
    again. Then rank 0's node loses its memory before any new snapshot (a second failure
    in the same block): the restore finds the same step whole on rank 1's node alone
    (its own files written back, rank 0's replicated there), bit for bit. The journal
    goes on from there: the next take is an entry, the one after the full snapshot due."""
    rank = dist.get_rank()
    torch.manual_seed(7 + rank)
    model, opt, sched, data, snaps = _journaled(2, "adamw", None, folder)
    try:
        states, losses = {}, {}
        for s in range(5):
            losses[s] = _step(model, opt, sched, s)
            data["next_step"] = s + 1
            states[s + 1] = _state(model, opt)
            if s < 3:
                assert snaps.take(s + 1)  # a full snapshot at 1, entries at 2 and 3
        for lost in (1, 0):
            snaps.wait()  # the snapshots (and a restore's republishing) are complete
            if rank == lost:
                snaps.store.drop()
            dist.barrier()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert snaps.resume(f"{folder}/ckpt") == 3, lost
            assert not [w for w in caught if "resume" in str(w.message)], lost
            assert snaps.last_resume is not None and snaps.last_resume.source == "memory"
            assert (snaps.last_resume.fetched_bytes > 0) == (rank == lost), lost
            _equal(_state(model, opt), states[3])
        for s in range(3, 5):
            assert _step(model, opt, sched, s) == losses[s], s
            data["next_step"] = s + 1
            _equal(_state(model, opt), states[s + 1])
            assert snaps.take(s + 1)
        snaps.wait()
        kinds = {h.step: h.kind for h in snaps.store.held() if h.rank == rank}
        assert kinds == {5: OWN}, kinds  # 4 an entry, then 5 full: 1 to 4 dropped
    finally:
        snaps.close()


def _refusals(folder: str) -> None:
    model, opt, _ = _build(2, "adamw")
    with pytest.raises(ValueError, match="full_every=4 needs every=1"):
        Snapshots(model, opt, every=2, full_every=4, root=folder)
    with pytest.raises(ValueError, match=r"needs .* GiB \(.* bytes\) of shared memory.* journal"):
        Snapshots(model, opt, every=1, full_every=10**12, root=folder)
    # A journal on one rank only (its room check a collective the other never joined;
    # the other's restore then read its answer: a hang or a TypeError on one rank).
    with pytest.raises(ValueError, match=r"ranks disagree at Snapshots on full_every"):
        Snapshots(model, opt, every=1, full_every=4 if dist.get_rank() == 0 else 1, root=folder)


def _node_entry_bytes(snaps: Snapshots, step: int) -> int:
    """The gradient and buffer bytes of the journal entries of `step` this rank's node
    holds (its ranks' own and the replicas they keep), read from the files (0 on a node's
    later ranks)."""
    here = snaps.placement.node_ranks(snaps.placement.nodes[snaps.rank])
    if here[0] != snaps.rank:
        return 0
    total = 0
    for h in snaps.store.held():
        if h.step == step:
            assert h.kind in (ENTRY, ENTRY_REPLICA), h
            path = snaps.store.path(h.step, h.rank, h.world_size, h.kind)
            snap = parse(mapped(path), str(path))
            total += sum(t.numel() * t.element_size() for t in snap.tensors.values())
    return total


def _room(folder: str) -> None:
    """Ranks 0 and 1 one node (two workers of one torchrun agent: the same parent and
    rendezvous id), rank 2 another: rank 2 keeps the replicas of both, rank 0 of rank 2,
    rank 1 none. Each node's journal need, as the refusal says it, is K times the entry
    bytes the node really holds (read from the entries of a journaled step); on the
    filesystem of `folder` a K whose need is twice the free space is refused on every
    rank, one needing 4/5 of it is not."""
    rank = dist.get_rank()
    if rank < 2:
        os.environ[RUN_ID] = "room"
    try:
        model, opt, sched = _build(2, "adamw")
        snaps = Snapshots(model, opt, every=1, full_every=3, root=folder)
        try:
            assert snaps.placement.buddy == (2, 2, 0)
            for s in range(2):  # a full snapshot of step 1, an entry of step 2
                _step(model, opt, sched, s)
                assert snaps.take(s + 1)
            snaps.wait()
            held: list[int | None] = [None] * 3
            dist.all_gather_object(held, _node_entry_bytes(snaps, 2))
        finally:
            snaps.close()
        node_a, node_b = held[0], held[2]
        assert node_a and node_b and held[1] == 0  # 3 entries each: own ones, replicas
        stat = os.statvfs(folder)
        # Rank 0's reading on every rank: every rank must pass the same full_every.
        free_at = [stat.f_bavail * stat.f_frsize]
        dist.broadcast_object_list(free_at, src=0)
        free = free_at[0]
        # Room for 4/5 of the free space: each node holds 3 entries a step; counting 2 per
        # rank (one ward each) would make node a's 4, over the free space.
        fits = int(0.8 * free / max(node_a, node_b))
        Snapshots(model, opt, every=1, full_every=fits, root=folder).close()
        k = 2 * free // node_a
        with pytest.raises(ValueError) as refused:
            Snapshots(model, opt, every=1, full_every=k, root=folder)
        # Rank 0's node is the first short one; the figure is what it would hold.
        assert f"({k * node_a:,} bytes) for the journal" in str(refused.value)
        assert str(refused.value).startswith(f"Snapshots(full_every={k}): rank 0's node ")
    finally:
        os.environ.pop(RUN_ID, None)


def test_journal_room_counts_what_each_node_holds(tmp_path: Path) -> None:
    """`Snapshots(full_every=K)` prices each node's journal by the entries its ranks
    keep, their own and their wards' (a rank may keep several or none), against the free
    space of the node's `root` (here the filesystem of the test's folder)."""
    run_ranks(_room, 3, str(tmp_path))


BF16 = {"compute_dtype": "bf16", "master_dtype": "bf16"}
SCALE = {"initial_loss_scale": 2.0**22}
CASES: list[tuple[int, str, dict[str, object], bool]] = [
    (2, "adamw", {}, False),
    (3, "sgd", {}, False),
    (2, "adamw", {}, True),
    (1, "adamw", {"offload_optimizer": True}, False),
    (2, "adamw", BF16, False),
    # Offloaded gradients narrower than fp32 keep their clipping and unscaling factors
    # pending until the step reads them: an entry holds them as the step read them.
    (2, "adamw", {"offload_optimizer": True, **BF16}, False),
    # A first loss scale that overflows until 2**16: steps 0-5 are skipped (journaled so:
    # the entry of step 6 replays a skip), step 6 on are stepped (offloaded, unscaled as
    # the host step reads them).
    (3, "adamw", {"offload_optimizer": True, "compute_dtype": "fp16", **SCALE}, False),
    # Several optimizers; hybrid sharding (each rank a shard group, the two replicas
    # averaged).
    (2, "sgd+adamw", {}, False),
    (3, "adamw", {"shard_group_size": 1}, False),
    # Whole-matrix optimizers: the replay's exchanges, every rank stepping its entries
    # together; with offload (Muon's elementwise parts on the host).
    (2, "muon", {}, False),
    (3, "muon", {"offload_optimizer": True, "compute_dtype": "bf16"}, False),
    (3, "factored", {}, False),
]


def _cases(folder: str) -> None:
    run_each(
        [
            {"folder": f"{folder}/{i}", "stage": s, "kind": k, "extra": x, "damage": d}
            for i, (s, k, x, d) in enumerate(CASES)
        ],
        _journal,
    )
    _falls_back_to_full(f"{folder}/fallback")
    _nodes_lost_in_turn(f"{folder}/lost")
    _refusals(f"{folder}/refusals")


def test_journal_replays_to_the_uninterrupted_run(tmp_path: Path) -> None:
    """Stage 2 with AdamW and stage 3 with SGD (momentum), restored at step 7 from the
    full snapshot of step 5 and the entries of 6 and 7; stage 2 with rank 1's entry of
    step 6 damaged in both copies, restored at step 5 with one warning; stage 1 with
    offload_optimizer (gradients on the host), bf16 masters (offloaded too: their
    clipping factors pending on the host), fp16 with skipped steps (offloaded), several
    optimizers, hybrid sharding, Muon (offloaded too, with bf16 gradients), a declared
    whole-matrix optimizer. The peer's entries kept in a ring of slots; the journal going
    on after a restore. A step's gradients zeroed in place before `take`, or two steps
    between takes: a full snapshot, one warning. Each node's memory lost in turn within
    one block: both restores from memory (the first one's files put back and replicated
    again). Refused: every > 1, a journal larger than the shared memory free, full_every
    differing between ranks."""
    run_ranks(_cases, 2, str(tmp_path))


OFFLOAD = {"offload_optimizer": True}
DELAYED = {"offload_delay_param_update": True}
# Each schedule of the offloaded step: its case (stage, optimizer, config).
SCHEDULES: dict[str, list[tuple[int, str, dict[str, object]]]] = {
    # Groups stepped on the stepping thread as their gradients land, recorded there just
    # before the step reads them: half the groups left on the device (stepped at step()),
    # bf16 masters, Muon's groups beside them (held until step()).
    "step_in_backward": [
        (2, "adamw", {**OFFLOAD, "offload_ratio": 0.5}),
        (3, "adamw", {**OFFLOAD, **BF16}),
        (3, "muon", {**OFFLOAD, "compute_dtype": "bf16"}),
    ],
    # The host step of each step() runs beside the next window, forward one step behind
    # the masters: the replay re-creates the lag (the losses after the restore repeat the
    # uninterrupted run's only so). Half the groups on the device; bf16 masters (their
    # clipping factors pending on the host).
    "delay_param_update": [
        (2, "fused", {**OFFLOAD, **DELAYED, "offload_ratio": 0.5}),
        (1, "fused", {**OFFLOAD, **DELAYED, **BF16}),
    ],
}


def _schedule_cases(folder: str, schedule: str) -> None:
    run_each(
        [
            {"folder": f"{folder}/{i}", "stage": s, "kind": k, "extra": x, "damage": False}
            | {"schedule": schedule}
            for i, (s, k, x) in enumerate(SCHEDULES[schedule])
        ],
        _journal,
    )


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_journal_replays_the_offload_schedules(tmp_path: Path, schedule: str) -> None:
    """step_in_backward: an entry holds each offloaded group's gradient as the step in
    backward read it (from a staging slot, gone by `step()`), and the replay steps it at
    `step()`, the same bits; beside groups on the device and Muon's, stepped at `step()`.
    delay_param_update: the replay ends with the masters of step 7 and forward computing
    at those of step 6, as the uninterrupted run at `take(7)`."""
    run_ranks(_schedule_cases, 2, str(tmp_path), schedule)


def _windows_run(folder: str | None, stage: int) -> tuple[dict[str, torch.Tensor], object]:
    """Three steps, the second a `step()` with no backward before it (a window whose batch
    the loop skipped), AdamW with weight decay; with `folder`, journaled (a full
    snapshot at 1, entries at 2 and 3): the state after."""
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, zopt = zs.initialize(model, opt, {"stage": stage, "min_unit_params": 1})
    snaps = None if folder is None else Snapshots(model, zopt, every=1, full_every=4, root=folder)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for s in range(3):
        if s != 1:
            model(torch.randn(4, 8, generator=gen)).square().mean().backward()
        zopt.step()
        zopt.zero_grad()
        if snaps is not None:
            assert snaps.take(s + 1)
    return _state(model, zopt), (model, zopt, snaps)


def _unused_group_cases(folder: str) -> None:
    for stage in (2, 3):
        plain, _ = _windows_run(None, stage)
        journaled, (model, opt, snaps) = _windows_run(f"{folder}/{stage}", stage)
        assert isinstance(snaps, Snapshots)
        try:
            # Journaling changes nothing: no group is stepped where it took no gradient.
            _equal(journaled, plain)
            assert snaps.resume(f"{folder}/{stage}/ckpt") == 3
            assert snaps.last_resume is not None and snaps.last_resume.source == "memory"
            _equal(_state(model, opt), journaled)
        finally:
            snaps.close()


def test_journal_leaves_a_group_without_gradient_unstepped(tmp_path: Path) -> None:
    """A flat group that took no gradient in a step's window (reduced gradients of unused
    parameters are zeros, so this is a window with no backward) is not stepped, and the
    journal neither records it nor steps it on replay: the journaled run equals the
    plain one, and the replay of entries 2 (no gradient) and 3 lands on it, bit for bit,
    at stages 2 and 3."""
    run_ranks(_unused_group_cases, 2, str(tmp_path))
