"""Restarting from the newest step the snapshots in memory cover, else from disk.

[Note: restoring from memory]
1. Inventory: the first rank of each node lists the node's snapshot files, and every
   rank gets every node's list (over the snapshots' group).
2. Plan (`plan_restore`, the same on every rank): the newest step S at which every
   rank r of this world has a file of its state at S, for this world size, on some
   node, none of those found bad: a full snapshot F = S, or one F < S followed by
   journal entries F+1..S of every rank ([Note: the gradient journal] in _journal.py);
   each rank's source of each file is its own node's if there is one (read from shared
   memory), else the first node's that holds one (its first rank sends it).
3. Fetch and check: every rank reads or receives its file and checks its checksum, that it
   is its own state at S, and that it fits this engine (`check_snapshot`). The ranks
   then share their outcomes: if any file failed, it is marked bad on every rank and
   the plan is made again (the other copy may be whole), else
4. every rank puts its state back (`apply_snapshot`, the checkpoint's own phases) and
   replays the entries (`replay`), each node keeps steps F..S only, and the background
   thread, for F and then each entry in turn, writes each rank's own copy where it was
   fetched from another node and replicates every rank's again (an entry's replica into
   its place in the ring: [Note: the replicas' ring] in _replicas.py), so a second
   failure before the next snapshot, even of the other node, finds F..S whole. The
   journal goes on from F: the entries are the ring's first, and the next `take` is an
   entry unless a full snapshot is due.
   Where a damaged file made it restore an older step than the newest held, one
   warning says which and how many steps that costs.
5. When no step is covered, the snapshots are dropped and `resume_checkpoint` loads
   the newest intact checkpoint from disk; one warning on rank 0 says why, and how many
   steps behind the newest snapshot that is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist

from zeroshard.ckpt import CheckpointError
from zeroshard.comm import warn_on_rank0
from zeroshard.engine.recovery import _file, _wire
from zeroshard.engine.recovery._contents import Checked, apply_snapshot, check_snapshot
from zeroshard.engine.recovery._file import Snapshot
from zeroshard.engine.recovery._journal import Entry, check_entry, replay
from zeroshard.engine.recovery._room import made
from zeroshard.engine.recovery._store import ENTRY, ENTRY_REPLICA, OWN, Held
from zeroshard.engine.state._checkpoint import every_rank
from zeroshard.engine.state._resume import resume_checkpoint

if TYPE_CHECKING:
    from zeroshard.engine.recovery._snapshots import Snapshots


class Source(NamedTuple):
    """Where a rank's snapshot comes from: a file of `node`, read by rank `server`."""

    node: str
    held: Held
    server: int


class Resumed(NamedTuple):
    """What `Snapshots.resume` did: the step (None: a fresh start), where from
    ('memory', 'disk' or 'fresh'), how long finding and fetching the snapshots
    (`fetch_s`) and putting the state back (`load_s`) took on this rank, and the bytes it
    received from another rank (0: read from its own node's memory, or from disk)."""

    step: int | None
    source: str
    fetch_s: float
    load_s: float
    fetched_bytes: int


Bad = tuple[str, Held]


class Plan(NamedTuple):
    """What a restore reads: the full snapshot of step `full` (each rank's source), then
    the journal entries of steps full+1..`step` (each step's sources)."""

    step: int
    full: int
    sources: list[Source]
    entries: list[tuple[int, list[Source]]]


Holders = dict[tuple[int, int], list[tuple[str, Held]]]


def _covered(holders: Holders, step: int, nodes: Sequence[str]) -> list[Source] | None:
    """Each rank's source of its file of `step` in `holders`; None if a rank has none."""
    first = {n: nodes.index(n) for n in dict.fromkeys(nodes)}
    sources = []
    for rank in range(len(nodes)):
        there = holders.get((step, rank), [])
        if not there:
            return None
        # Its own node first (no transfer), its own copy before a replica.
        node, held = min(
            there, key=lambda nh: (nh[0] != nodes[rank], nh[1].kind not in (OWN, ENTRY))
        )
        sources.append(Source(node, held, rank if node == nodes[rank] else first[node]))
    return sources


def plan_restore(
    world_size: int,
    nodes: Sequence[str],
    inventory: Mapping[str, Sequence[Held]],
    bad: set[Bad],
) -> Plan | None:
    """The newest step every rank's snapshot (or full snapshot and journal entries)
    covers, and each rank's sources (see [Note: restoring from memory]); None when no
    step is covered. `nodes[r]` is rank r's node."""
    first = {n: nodes.index(n) for n in dict.fromkeys(nodes)}
    fulls: Holders = {}
    entries: Holders = {}
    for node in sorted(inventory, key=lambda n: first.get(n, len(nodes))):
        for h in inventory[node]:
            if h.world_size == world_size and (node, h) not in bad and node in first:
                into = entries if h.kind in (ENTRY, ENTRY_REPLICA) else fulls
                into.setdefault((h.step, h.rank), []).append((node, h))
    best = None
    for full in sorted({s for s, _ in fulls}, reverse=True):
        sources = _covered(fulls, full, nodes)
        if sources is None:
            continue
        step, journal = full, []
        while (more := _covered(entries, step + 1, nodes)) is not None:
            step += 1
            journal.append((step, more))
        if best is None or step > best.step:
            best = Plan(step, full, sources, journal)
    return best


def _inventory(snaps: Snapshots) -> dict[str, list[Held]]:
    placement = snaps.placement
    me = snaps.rank
    node = placement.nodes[me]
    mine = snaps.store.held() if placement.node_ranks(node)[0] == me else None
    everyone: list[list[Held] | None] = [None] * snaps.world_size
    dist.all_gather_object(everyone, mine, group=snaps._pg)
    return {
        placement.nodes[r]: [Held(*h) for h in held]
        for r, held in enumerate(everyone)
        if held is not None
    }


def _fetch(snaps: Snapshots, step: int, sources: list[Source]) -> torch.Tensor:
    """This rank's snapshot bytes (serving the ranks it is the source of)."""
    me, world = snaps.rank, snaps.world_size
    works: _wire.Works = []
    keep = []
    for target, src in enumerate(sources):
        if src.server == me and target != me:
            h = src.held
            try:
                buf = _file.mapped(snaps.store.path(step, h.rank, world, h.kind))
            except OSError:  # gone meanwhile: the target finds the bytes bad, not hangs
                buf = torch.zeros(0, dtype=torch.uint8)
            if buf.numel() != h.size:
                buf = torch.zeros(h.size, dtype=torch.uint8)
            keep.append(buf)
            works += _wire.send_bytes(snaps._pg, buf, target)
    src = sources[me]
    if src.server == me:
        out = _file.mapped(snaps.store.path(step, me, world, src.held.kind))
    else:
        out = torch.empty(src.held.size, dtype=torch.uint8)
        works += _wire.recv_bytes(snaps._pg, out, src.server)
    _wire.wait(works)
    return out


def _outcomes(snaps: Snapshots, problem: tuple[str, int] | None) -> list[tuple[str, int] | None]:
    everyone: list[tuple[str, int] | None] = [None] * snaps.world_size
    dist.all_gather_object(everyone, problem, group=snaps._pg)
    return everyone


class Republish(NamedTuple):
    """A file of a restore for the background thread to put back in place, in the plan's
    order: its `step`, what writes this rank's own copy to its node where it came from
    elsewhere (and returns its bytes), and for a journal entry its place in the plan's
    entries (None: the full snapshot), the place of its replica in the ring."""

    step: int
    own: Callable[[], torch.Tensor]
    entry: int | None


def _republisher(
    snaps: Snapshots, step: int, src: Source, buf: torch.Tensor, entry: int | None
) -> Republish:
    """See `Republish`."""
    kind = OWN if entry is None else ENTRY

    def own() -> torch.Tensor:
        if src.node == snaps.placement.nodes[snaps.rank] and src.held.kind == kind:
            return buf
        final = snaps.store.path(step, snaps.rank, snaps.world_size, kind)
        temp = snaps.store.temp(final)
        copy = made(temp, buf.numel(), f"rank {snaps.rank}'s copy of step {step}")
        copy.copy_(buf)
        snaps.store.commit(temp, final)
        return copy

    return Republish(step, own, entry)


def _read(
    snaps: Snapshots, plan: Plan
) -> tuple[list[torch.Tensor], tuple[str, int] | None, Checked | None, list[Entry]]:
    """Fetch this rank's files of `plan` (the full snapshot's, then each entry's; serving
    the ranks it is a source of) and check them: the bytes, the problem found (its text
    and the file's index in the plan) or the checked contents."""
    state, me = snaps._state, snaps.rank
    files = [(plan.full, plan.sources), *plan.entries]
    bufs: list[torch.Tensor] = []
    problem = None
    for i, (step, sources) in enumerate(files):
        try:
            bufs.append(_fetch(snaps, step, sources))
        except OSError as e:
            bufs.append(torch.empty(0, dtype=torch.uint8))
            problem = problem or (str(e), i)
    if problem is not None:
        return bufs, problem, None, []
    checked = None
    entries = []
    for i, ((step, sources), buf) in enumerate(zip(files, bufs, strict=True)):
        src = sources[me]
        what = "journal entry" if i else "snapshot"
        where = f"{what} of rank {me} at step {step} (node {src.node}, {src.held.kind})"
        try:
            _file.check(buf, where)
            snap = _file.parse(buf, where)
            _check_identity(snaps, snap, step, where)
            if i == 0:
                checked = check_snapshot(state, snap, where, snaps.client_state, snaps.rank_state)
            else:
                entries.append(
                    check_entry(
                        state, snaps._model, snap, where, snaps.client_state, snaps.rank_state
                    )
                )
        except (CheckpointError, OSError) as e:
            return bufs, (str(e), i), None, []
    return bufs, None, checked, entries


def _check_identity(snaps: Snapshots, snap: Snapshot, step: int, where: str) -> None:
    if (snap.step, snap.rank, snap.world_size) != (step, snaps.rank, snaps.world_size):
        raise CheckpointError(
            f"{where} holds rank {snap.rank}'s state at step {snap.step} of {snap.world_size} ranks"
        )


@torch.no_grad()
def resume(snaps: Snapshots, directory: Path) -> tuple[Resumed, list[Republish]]:
    """See [Note: restoring from memory]; what to republish in the background (the full
    snapshot, then each entry)."""
    state, model = snaps._state, snaps._model
    me = snaps.rank
    t0 = time.perf_counter()
    inventory = _inventory(snaps)
    newest = max((h.step for held in inventory.values() for h in held), default=None)
    bad: set[Bad] = set()
    why: list[str] = []
    label = f"Snapshots.resume({str(directory)!r})"
    while (
        plan := plan_restore(snaps.world_size, snaps.placement.nodes, inventory, bad)
    ) is not None:
        bufs, problem, checked, entries = _read(snaps, plan)
        fetch_s = time.perf_counter() - t0
        outcomes = _outcomes(snaps, problem)
        if any(outcomes):
            files = [plan.sources, *(sources for _, sources in plan.entries)]
            for rank, found in enumerate(outcomes):
                if found is not None:
                    text, i = found
                    bad.add((files[i][rank].node, files[i][rank].held))
                    why.append(text)
            continue
        assert checked is not None
        t1 = time.perf_counter()
        everyone = every_rank(state)
        apply_snapshot(model, state, everyone, label, checked, snaps.client_state, snaps.rank_state)
        if entries:
            replay(model, state, everyone, label, entries, snaps.client_state, snaps.rank_state)
        _keep_only(snaps, plan.full, plan.step)
        if why:
            assert newest is not None
            warn_on_rank0(
                f"resume: skipped damaged snapshots ({'; '.join(why)}): resumed from step "
                f"{plan.step}, {newest - plan.step} step(s) behind the newest snapshot "
                f"(step {newest}), which are redone"
            )
        files = [plan.sources, *(sources for _, sources in plan.entries)]
        got = sum(b.numel() for b, f in zip(bufs, files, strict=True) if f[me].server != me)
        done = Resumed(plan.step, "memory", fetch_s, time.perf_counter() - t1, got)
        steps = [plan.full, *(step for step, _ in plan.entries)]
        places = [None, *range(len(plan.entries))]
        return done, [
            _republisher(snaps, step, f[me], buf, i)
            for step, f, buf, i in zip(steps, files, bufs, places, strict=True)
        ]
    _keep_only(snaps, None)
    t1 = time.perf_counter()
    disk = resume_checkpoint(
        model,
        state.optimizer,
        directory,
        client_state=snaps.client_state,
        rank_state=snaps.rank_state,
    )
    if newest is not None:
        at = 0 if disk is None else disk
        worlds = {h.world_size for held in inventory.values() for h in held}
        reason = "; ".join(why) or "some rank's snapshot is on no node left"
        if snaps.world_size not in worlds:
            reason = f"they are of {sorted(worlds)} ranks, this job has {snaps.world_size}"
        warn_on_rank0(
            f"resume: no step is covered by the snapshots in memory ({reason}): resumed "
            f"from {'step 0' if disk is None else f'the checkpoint of step {disk}'} on "
            f"disk, {newest - at} step(s) behind the newest snapshot (step {newest}), "
            "which are redone"
        )
    source = "fresh" if disk is None else "disk"
    return Resumed(disk, source, t1 - t0, time.perf_counter() - t1, 0), []


def _keep_only(snaps: Snapshots, first: int | None, last: int | None = None) -> None:
    """Each node keeps only the steps `first`..`last` (`first` alone without `last`; none
    without either)."""
    if snaps.placement.node_ranks(snaps.placement.nodes[snaps.rank])[0] == snaps.rank:
        if first is None:
            snaps.store.drop(None)
        else:
            snaps.store.keep_only(first, first if last is None else last)
    dist.barrier(group=snaps._pg)
