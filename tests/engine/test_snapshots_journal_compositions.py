"""The gradient journal (Snapshots(every=1, full_every=K): [Note: the gradient journal] in
zeroshard/engine/recovery/_journal.py) in combinations of features, each built by the
composition table's own recipes (tests/integration/test_composition.py), on 2 gloo ranks
each its own "node": a full snapshot at step 1 and journal entries at steps 2 and 3,
the run going on to step 5, rank 1's own entry of step 3 lost; `resume` loads step 1 and
replays the entries (the one lost from the replica its peer keeps) to step 3, bit for bit,
and the steps after it repeat the uninterrupted run's (losses and the state they leave,
bit for bit).

What each combination puts to the replay: zeroshard.compile's graph accumulating the
gradients into the masters' `.grad` (the journal's references must be what the step
read, not what the next compiled backward writes); the fp8 gather's scales, which live in
its wire and are taken from the masters at every publish (a replay publishes once, after
its last entry: no scale is journaled); tensor parallelism's DTensor layers, whose flat
groups hold the local pieces (dp 1 x tp 2 here); Muon under it, each replayed step
joining every matrix whole over tp at its owner as the training step did."""

from __future__ import annotations

import copy
from pathlib import Path

import torch.distributed as dist

import zeroshard.engine as zs
from tests._dist import run_ranks
from tests.engine.test_snapshots_compositions import recipe, resumes_and_repeats
from tests.integration.test_composition import build, state_of
from zeroshard.comm import Group
from zeroshard.engine.recovery._store import ENTRY, ENTRY_REPLICA, OWN, REPLICA
from zeroshard.engine.runtime._wire import WireKind

CASES = [
    ("zeroshard.compile", "fp8 gather"),
    ("zeroshard.compile", "tensor parallelism"),
    ("stage 2", "tensor parallelism", "Muon", "offload_optimizer"),
    ("fp8 gather", "Muon", "bf16 masters"),
]


def _replays(features: tuple[str, ...], folder: Path, own: Group) -> None:
    built = build(recipe(features), own)
    model, opt, step = built.model, built.opt, built.step
    rank, world = dist.get_rank(), dist.get_world_size()
    if "fp8 gather" in features:  # gathered in fp8, its scales in the wire
        assert any(g.wire.kind is WireKind.FLOAT8 for g in zs.engine_state(model).groups)
    snaps = zs.Snapshots(model, opt, every=1, full_every=3, root=folder / "shm")
    try:
        losses, states = [], []
        for s in range(5):
            losses.append(step())
            states.append(copy.deepcopy(state_of(model, opt)))
            if s < 3:
                assert snaps.take(s + 1)
        snaps.wait()
        held = {(h.step, h.rank, h.kind) for h in snaps.store.held()}
        peer = 1 - rank
        want = {(1, rank, OWN), (1, peer, REPLICA)}
        want |= {(s, r, k) for s in (2, 3) for r, k in ((rank, ENTRY), (peer, ENTRY_REPLICA))}
        assert held == want, f"{features}: {held}"
        if rank == 1:
            snaps.store.path(3, 1, world, ENTRY).unlink()
        dist.barrier()
        resumes_and_repeats(features, built, snaps, folder, 3, losses, states)
    finally:
        snaps.close()


def _cases(folder: str) -> None:
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    own = Group(singles[dist.get_rank()])
    for i, features in enumerate(CASES):
        _replays(features, Path(folder) / str(i), own)


def test_journal_replays_in_combinations(tmp_path: Path) -> None:
    """Compiled with the fp8 gather; compiled under tensor parallelism (dp 1 x tp 2);
    Muon offloaded at stage 2 under tensor parallelism; the fp8 gather with Muon and bf16
    masters."""
    run_ranks(_cases, 2, str(tmp_path), timeout_s=600)
