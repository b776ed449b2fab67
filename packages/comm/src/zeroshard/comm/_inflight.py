"""What gloo still holds: tensors of issued collectives, drained before the interpreter exits.

[Note: gloo at interpreter exit]
A gloo collective runs on the process group's worker thread, and the `Work` it runs
holds the collective's tensors. That thread lets go of the `Work` after it has marked it
complete (or failed), so the last reference to a tensor can be the worker's: always for
a collective that timed out (its `Work` outlives our wait until gloo's own timeout ends
it) and for the queued collectives behind it, and now and then, on a loaded machine, for
one that just finished. When Python has dropped such a tensor first, torch keeps its
Python object alive for the C++ owner, and the worker thread frees it, taking the GIL,
possibly while the interpreter shuts down (the script caught zeroshard's error and
returned). Scripts in that state were seen to die with SIGABRT ("terminate called without
an active exception") instead of the exit status they chose; that the pending `Work` is
the cause is inferred (docs/reliability.md), but no `Work` of ours is left pending now.

So every tensor a gloo collective of zeroshard's is given is a private alias (a view of
the caller's tensor, or of zeroshard's own copy) that only its `Work` references,
tracked here by a weak reference: it dies exactly when the `Work` goes. An
`atexit` hook waits, before finalization begins, until every alias is gone, for as long
as gloo keeps making progress: an abandoned collective ends by the process group's own
timeout (`Group.with_timeout` sets it), each queued one after it in turn.
"""

from __future__ import annotations

import atexit
import sys
import time
import weakref

import torch
import torch.distributed as dist

_POLL_S = 0.01

# id(weak reference to an alias) -> (that reference, one to its `Work`, the collective's
# timeout in seconds). No lock: single dict operations are atomic under the GIL, and a
# lock taken here could be re-entered by a release callback run from a garbage
# collection on the same thread.
_held: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[dist.Work], float]] = {}


def private_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A view of `tensor` to hand to a gloo collective, then to `track` with its `Work`."""
    return tensor.view(tensor.shape)


def track(work: dist.Work, aliases: tuple[torch.Tensor, ...], timeout_s: float) -> None:
    """Follow `aliases` (given to `work` only, dropped by the caller) until gloo frees them.

    Each dies with the `Work`, on whichever thread drops that last (see [Note: gloo at
    interpreter exit]).
    """

    def released(ref: weakref.ref[torch.Tensor]) -> None:
        _held.pop(id(ref), None)

    work_ref = weakref.ref(work)
    for alias in aliases:
        ref = weakref.ref(alias, released)
        _held[id(ref)] = (ref, work_ref, timeout_s)


def held_by_gloo() -> int:
    """How many tensors handed to gloo collectives gloo may still hold.

    Not counted: those of a finished `Work` that Python still holds (a handle never
    waited): Python, on the main thread, lets go of that last.
    """
    return sum(1 for entry in tuple(_held.values()) if _pending(*entry))


def _pending(alias: weakref.ref[torch.Tensor], work: weakref.ref[dist.Work], _: float) -> bool:
    held = work()
    return alias() is not None and (held is None or not held.is_completed())


def drain(grace_s: float = 2.0) -> bool:
    """Wait until gloo holds none of zeroshard's tensors; True if it let go of all.

    Waits as long as gloo makes progress: each release restarts a window of the longest
    pending collective's timeout plus `grace_s`. Sleeping releases the GIL, which the
    worker thread needs to free what it held.
    """
    count = held_by_gloo()
    deadline = time.monotonic() + _window(grace_s)
    while count:
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)
        now = held_by_gloo()
        if now < count:
            count = now
            deadline = time.monotonic() + _window(grace_s)
    return True


def _window(grace_s: float) -> float:
    return max((e[2] for e in tuple(_held.values()) if _pending(*e)), default=0.0) + grace_s


@atexit.register
def _drain_at_exit() -> None:
    # Registered when zeroshard.comm is first imported, hence run after the atexit hooks
    # of the packages above it (an async save's commit issues collectives too).
    if not drain():
        print(
            f"zeroshard: {held_by_gloo()} tensor(s) of gloo collectives still held at exit "
            "(a collective still running past its timeout); torch's teardown may abort",
            file=sys.stderr,
            flush=True,
        )
