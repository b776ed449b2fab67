"""`arrive`: every rank of a group comes to a call within seconds, or every rank that
came raises.

[Note: arriving at a collective call]
A call every rank must make (a stage-3 `state_dict()` gathers every flat group), made
on some ranks only (`if rank == 0: model.state_dict()`, the DDP habit), would wait in
its first collective for the whole collective timeout (10 minutes by default), then
name only that collective. So such a call first arrives, through the process group's
store rather than a collective (a rank that never comes leaves no collective half
matched behind): each rank adds itself to the count of the call's current round; the
last one decides "go"; a rank that waited `within` seconds without a decision decides
"fail". The first decision stands (`compare_set`), so every rank of the round follows
the same one, and deciding moves the call to a new round, so a rank arriving later
starts afresh rather than joining a round already decided. Ranks that reach the call
further apart than `within` (one evaluates alone first) fail alike: let them meet first
(`dist.barrier()`). Cost: a few store round trips per call (a millisecond or so).
"""

from __future__ import annotations

import datetime
import hashlib
import time

import torch.distributed as dist
from torch.distributed.distributed_c10d import Store

from zeroshard.comm._errors import CollectiveTimeoutError
from zeroshard.comm._group import Group

# How long the ranks may reach a call apart: bounded by the group's own timeout.
ARRIVAL_WINDOW = datetime.timedelta(seconds=30)
_GO, _FAIL = "go", "fail"


def arrive(group: Group, call: str, fix: str) -> None:
    """Return once every rank of `group` has come to `call`; if one has not within
    `ARRIVAL_WINDOW` (or the group's timeout, if shorter), raise `CollectiveTimeoutError`
    on every rank that came, naming `call` and `fix`. See [Note: arriving at a collective
    call]. Without a process group, or on one rank, there is nothing to wait for."""
    if not dist.is_initialized() or group.size == 1:
        return
    within = min(ARRIVAL_WINDOW, group.timeout)
    store = dist.distributed_c10d._get_default_store()
    ranks = ",".join(str(group.global_rank(r)) for r in range(group.size))
    base = (
        "zeroshard/arrive/" + hashlib.blake2b(f"{call}@{ranks}".encode(), digest_size=8).hexdigest()
    )
    current = f"{base}/round"
    round_ = store.add(current, 0)
    key = f"{base}/{round_}"
    start = time.monotonic()
    came = store.add(f"{key}/count", 1)
    decided = None
    if came < group.size:
        decided = _await(store, f"{key}/decision", start + within.total_seconds())
    if decided is None:
        decided = _decide(store, current, round_, key, _GO if came >= group.size else _FAIL)
    if decided != _GO:
        came = store.add(f"{key}/count", 0)
        cause = RuntimeError(
            f"{call} is collective: every rank of the group must call it, and only {came} "
            f"of its {group.size} ranks did within {within.total_seconds():g}s. {fix}"
        )
        raise CollectiveTimeoutError(
            "arrival", call, within, cause, elapsed=time.monotonic() - start
        )


def _decide(store: Store, current: str, round_: int, key: str, want: str) -> str:
    """Move the call to the next round, then decide this one (the first decision stands)."""
    store.compare_set(current, str(round_), str(round_ + 1))
    return bytes(store.compare_set(f"{key}/decision", "", want)).decode()


def _await(store: Store, decision: str, deadline: float) -> str | None:
    """The round's decision once made, or None at `deadline` (polled: a store's own
    wait logs a warning when it times out)."""
    pause = 0.001
    while time.monotonic() < deadline:
        if store.check([decision]):
            return bytes(store.get(decision)).decode()
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    return bytes(store.get(decision)).decode() if store.check([decision]) else None
