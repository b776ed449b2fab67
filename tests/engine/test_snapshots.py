"""Snapshots in memory (zeroshard.engine.recovery) on 2 gloo ranks, each its own "node"
(`run_ranks` starts every rank as its own process outside torchrun): a restore puts
back what the snapshot held, bit for bit, from the rank's own copy or, where that is
gone or damaged, from the replica its peer keeps; with both gone it falls back to the
disk checkpoint with one warning. The kills under torchrun are tests/faults/
test_snapshot_restart.py's."""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks, world_fits
from tests.engine._models import global_batches, loss_fn, make_model, make_optimizer
from zeroshard.engine.recovery import Snapshots
from zeroshard.engine.recovery._places import Placement
from zeroshard.engine.recovery._restore import plan_restore
from zeroshard.engine.recovery._store import ENTRY, ENTRY_REPLICA, OWN, REPLICA, Held


def _build(stage: int, device: str) -> tuple[torch.nn.Module, zs.ZeroOptimizer, object]:
    model = make_model(11).to(device)
    config = {"stage": stage, "min_unit_params": 1}
    model, opt = zs.initialize(model, make_optimizer(model), config)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _step(model: torch.nn.Module, opt: zs.ZeroOptimizer, sched: object, step: int) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = global_batches(8, 1, 12, 1)[step, 0]
    x = batch.reshape(world, -1, batch.shape[-1])[rank].to(next(model.parameters()).device)
    noise = torch.rand(())  # an RNG draw per step: the restored RNG must give it again
    loss = loss_fn(model, x) * (1 + 0.01 * noise)
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()  # type: ignore[attr-defined]
    return float(loss.detach())


def _state(model: torch.nn.Module, opt: zs.ZeroOptimizer) -> dict[str, torch.Tensor]:
    out = {f"p.{k}": v.clone() for k, v in zs.full_state_dict(model).items()}
    for i, g in enumerate(opt.param_groups):
        for j, p in enumerate(g["params"]):
            for k, v in opt.state.get(p, {}).items():
                out[f"o.{i}.{j}.{k}"] = torch.as_tensor(v).clone()
        out[f"lr.{i}"] = torch.tensor(g["lr"])
    return out


def _damage(snaps: Snapshots, step: int, rank: int, kinds: list[str], how: str) -> None:
    """On the rank that holds them: rank `rank`'s files of `kinds` at `step` deleted or flipped."""
    for kind in kinds:
        path = snaps.store.path(step, rank, 2, kind)
        if not path.exists():
            continue
        if how == "lose":
            path.unlink()
        else:
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x10
            path.write_bytes(data)


def _restore(folder: str, stage: int, damage: str, device: str) -> None:
    root, disk = f"{folder}/shm", f"{folder}/ckpt"
    rank = dist.get_rank()
    torch.manual_seed(7 + rank)
    random.seed(rank)
    model, opt, sched = _build(stage, device)
    data = {"next_step": 0}
    client = {"sched": sched, "data": data}
    mine = {"rng": zs.RNGState()}
    snaps = Snapshots(model, opt, every=2, client_state=client, rank_state=mine, root=root)
    try:
        assert snaps.placement.buddy == (1, 0)  # two "nodes": each keeps the other's replica
        assert snaps.resume(disk) is None and snaps.last_resume.source == "fresh"
        for s in range(4):
            _step(model, opt, sched, s)
            data["next_step"] = s + 1
            if s == 0:
                zs.save_checkpoint(model, opt, disk, step=1, client_state=client, rank_state=mine)
            assert snaps.take(s + 1) == (s % 2 == 1)
        snaps.wait()
        # Step 4 is complete: each node keeps its own copy and the other rank's replica,
        # and step 2 is gone.
        held = {(h.step, h.rank, h.kind) for h in snaps.store.held()}
        assert held == {(4, rank, OWN), (4, 1 - rank, REPLICA)}
        # The planner's count of a snapshot is the file's tensors (less its header, the
        # buffers, the user state and alignment).
        with torch.device("meta"):
            planned = zs.estimate(make_model(11), {"stage": stage, "min_unit_params": 1}, 2, 1, 4)
        size = snaps.store.path(4, rank, 2, OWN).stat().st_size
        assert planned.snapshot < size < planned.snapshot + 64 * 1024, (planned.snapshot, size)
        want = _state(model, opt)
        _step(model, opt, sched, 4)  # moved on past the snapshot
        if damage == "own-lost" and rank == 1:
            _damage(snaps, 4, 1, [OWN], "lose")
        if damage == "own-flipped":
            _damage(snaps, 4, 1, [OWN], "flip")
        if damage == "both-flipped":
            _damage(snaps, 4, 1, [OWN, REPLICA], "flip")
        dist.barrier()
        client["data"] = {"next_step": -1}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = snaps.resume(disk)
        texts = [str(w.message) for w in caught if "resume" in str(w.message)]
        if damage == "both-flipped":
            # Both copies of rank 1's step 4 damaged: step 2 was dropped once 4 was
            # complete, so the disk's step 1 it is, 3 steps behind.
            assert step == 1 and snaps.last_resume.source == "disk"
            assert client["data"] == {"next_step": 1}
            if rank == 0:
                assert len(texts) == 1 and "3 step(s) behind" in texts[0], texts
            return
        assert step == 4 and snaps.last_resume.source == "memory"
        assert client["data"] == {"next_step": 4}
        if damage == "own-flipped" and rank == 0:
            assert len(texts) == 1 and "skipped damaged" in texts[0] and "crc32c is" in texts[0]
        got = _state(model, opt)
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert torch.equal(got[k], v), k
        snaps.wait()  # the republish: every rank's copy and replica in place again
        held = {(h.step, h.rank, h.kind) for h in snaps.store.held()}
        assert held == {(4, rank, OWN), (4, 1 - rank, REPLICA)}
    finally:
        snaps.close()
    assert not snaps.store.folder.exists()


CASES = [(1, "none"), (3, "own-lost"), (3, "own-flipped"), (2, "both-flipped")]


def _cases(folder: str, device: str) -> None:
    run_each(
        [
            {"folder": f"{folder}/{i}", "stage": s, "damage": d, "device": device}
            for i, (s, d) in enumerate(CASES)
        ],
        _restore,
    )


@pytest.mark.gpu
def test_restore_from_memory(tmp_path: Path, device: str) -> None:
    """Stage 1 from the own copies; stage 3 with rank 1's own copy lost (from the replica
    on the other node), or flipped (the replica, one warning); stage 2 with both flipped
    (from disk, one warning saying how many steps behind). On CUDA the device's copy
    goes straight into pinned shared memory on a side stream, the next step waiting."""
    world_fits(device, 2)
    run_ranks(_cases, 2, str(tmp_path), device, device=device)


def test_placement_puts_replicas_on_the_next_node() -> None:
    two_by_two = Placement.of(["a", "a", "b", "b"])
    assert two_by_two.buddy == (2, 3, 0, 1) and two_by_two.spread
    assert two_by_two.wards(0) == [2]
    one_node = Placement.of(["a", "a", "a"])
    assert one_node.buddy == (1, 2, 0) and not one_node.spread
    assert Placement.of(["a"]).buddy == (None,)
    uneven = Placement.of(["a", "a", "a", "b"])
    assert uneven.buddy == (3, 3, 3, 0) and uneven.spread


def test_plan_prefers_own_node_and_skips_bad_copies() -> None:
    nodes = ["a", "a", "b", "b"]

    def held(step: int, rank: int, kind: str) -> Held:
        return Held(step, rank, 4, kind, 100)

    inv = {
        "a": [held(5, 0, OWN), held(5, 1, OWN), held(5, 2, REPLICA), held(5, 3, REPLICA)],
        "b": [held(5, 2, OWN), held(5, 0, REPLICA), held(5, 1, REPLICA), held(6, 2, OWN)],
    }
    plan = plan_restore(4, nodes, inv, set())
    assert plan is not None
    step, sources = plan.step, plan.sources
    assert step == 5 and plan.full == 5 and plan.entries == []  # step 6 is rank 2's only
    # Rank 3's own copy is gone (its node's memory): node a's first rank sends the replica.
    assert [(s.node, s.held.kind, s.server) for s in sources] == [
        ("a", OWN, 0),
        ("a", OWN, 1),
        ("b", OWN, 2),
        ("a", REPLICA, 0),
    ]
    bad = {("a", held(5, 3, REPLICA))}
    assert plan_restore(4, nodes, inv, bad) is None
    assert plan_restore(2, nodes[:2], inv, set()) is None  # another world size


def test_plan_replays_journal_entries_up_to_the_first_gap() -> None:
    """A full snapshot and the entries after it that every rank has; a damaged entry
    (or one rank's lacking) ends the steps there; the newest reachable step wins."""
    nodes = ["a", "b"]

    def held(step: int, rank: int, kind: str) -> Held:
        return Held(step, rank, 2, kind, 100)

    inv = {
        "a": [held(4, 0, OWN), held(4, 1, REPLICA), *(held(s, 0, ENTRY) for s in (5, 6, 7))],
        "b": [held(4, 1, OWN), held(5, 1, ENTRY), held(6, 1, ENTRY), held(6, 0, ENTRY_REPLICA)],
    }
    plan = plan_restore(2, nodes, inv, set())
    assert plan is not None and (plan.full, plan.step) == (4, 6)  # rank 1 has no entry 7
    assert [(s, [(x.node, x.held.kind) for x in src]) for s, src in plan.entries] == [
        (5, [("a", ENTRY), ("b", ENTRY)]),
        (6, [("a", ENTRY), ("b", ENTRY)]),
    ]
    plan = plan_restore(2, nodes, inv, {("a", held(6, 0, ENTRY))})
    assert plan is not None and plan.step == 6  # the replica on b covers rank 0's 6
    assert (plan.entries[1][1][0].node, plan.entries[1][1][0].server) == ("b", 1)
    plan = plan_restore(2, nodes, inv, {("b", held(5, 1, ENTRY))})
    assert plan is not None and (plan.full, plan.step, plan.entries) == (4, 4, [])
    # A newer full snapshot, every rank's, without entries: the newest step.
    inv["a"] += [held(8, 0, OWN)]
    inv["b"] += [held(8, 1, OWN)]
    plan = plan_restore(2, nodes, inv, set())
    assert plan is not None and (plan.full, plan.step) == (8, 8)


def _slots_kept(folder: str) -> None:
    model, opt, sched = _build(2, "cpu")
    # A header that grows at each step (the user's state, and StepLR's halving lr printed
    # longer): the sizes must still fit the slots the first takes mapped.
    data = {"log": ""}
    snaps = Snapshots(model, opt, every=1, full_every=3, client_state={"data": data}, root=folder)
    try:
        seen: dict[str, tuple[int, int]] = {}
        for s in range(8):
            _step(model, opt, sched, s)
            data["log"] += "x" * 40
            snaps.take(s + 1)
            rings = {"full": snaps._slots._slots, "entry": snaps._entries._slots}
            for name, ring in rings.items():
                if s == 0 and name == "entry":
                    assert ring == [None] * 3  # no entry size known yet
                    continue
                # The first take of each kind mapped its every slot; none is mapped again.
                assert all(slot is not None for slot in ring), (s, name)
                for k, slot in enumerate(ring):
                    key = (slot.path.stat().st_ino, slot.buf.data_ptr())  # type: ignore[union-attr]
                    assert seen.setdefault(f"{name}{k}", key) == key, (s, name, k)
        snaps.wait()
    finally:
        snaps.close()


def test_first_takes_map_every_slot_and_later_ones_reuse_them(tmp_path: Path) -> None:
    """A process's first full snapshot maps both slots, its first entry the journal's
    whole ring (later takes pay no mapping: [Note: slots]), and a header that grows a
    little from step to step is padded into the same slots."""
    run_ranks(_slots_kept, 1, str(tmp_path))
