"""`Snapshots`: every rank's state in host memory every N steps, with a replica on
another node, to restart from after a worker or a node is lost.

[Note: snapshot lifecycle]
`take(step)`, on every rank at the same steps:
1. The previous snapshot's background work is waited for (its error raised here).
2. On the calling thread: the rank's contents (`rank_contents`: what a checkpoint
   holds) laid out in one of its two slots in the node's shared memory ([Note: slots],
   [Note: a node's folder]); host tensors are copied into it now, device tensors start
   their copy on a side stream ([Note: the copy and the next step]). Training goes on.
3. A background thread waits for the copy, seals the bytes (crc32) and links them into
   place: the rank's own copy. Then it sends the bytes to the rank's buddy and
   receives its wards' ([Note: the snapshots' process group]), each sealed file
   renamed into place: the replicas. An all-reduce then says every rank's copy and
   replica of step S are in place: S is complete, and each rank removes the older steps
   of its node (a rank removes only once every rank finished S, so a step is held
   until a newer one is complete).
A node thus holds at most two steps: the newest complete one and the one in flight.
A kill at any point leaves at worst '.'-named files (never listed) and a step that is
not complete; `resume` ([Note: restoring from memory]) finds what is whole.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.comm import warn_on_rank0
from zeroshard.engine.recovery import _file, _wire
from zeroshard.engine.recovery._contents import rank_contents
from zeroshard.engine.recovery._host_copy import HostCopy
from zeroshard.engine.recovery._places import Placement, job_folder, node_key
from zeroshard.engine.recovery._restore import Resumed, resume
from zeroshard.engine.recovery._slots import Slots
from zeroshard.engine.recovery._store import OWN, REPLICA, NodeStore
from zeroshard.engine.runtime._state import EngineModel, engine_module, engine_state


class Snapshots:
    """Snapshots of every rank's state in host memory, replicated to another node.

    Call on every rank after `initialize`; `resume(directory)` instead of
    `resume_checkpoint` on start, `take(step)` where a checkpoint would be saved (after
    the step, the scheduler and the data position), `close()` at the end.
    `every`: `take` snapshots the steps it divides. `client_state` / `rank_state` are
    the mappings `save_checkpoint` takes, read at each snapshot. `root`: where the
    shared memory is (`/dev/shm`; the job's folder goes under it). Host memory per
    rank: docs/reliability.md, "Recovery from memory"; `zeroshard-plan --snapshots`.
    """

    def __init__(
        self,
        model: EngineModel,
        optimizer: torch.optim.Optimizer,
        *,
        every: int = 1,
        client_state: MutableMapping[str, Any] | None = None,
        rank_state: MutableMapping[str, Any] | None = None,
        root: str | os.PathLike[str] = "/dev/shm",
    ) -> None:
        self._model = engine_module(model)
        self._state = engine_state(self._model)
        engine_optimizer = self._state.needs_optimizer("Snapshots")
        if optimizer is not engine_optimizer:
            raise ValueError("pass the optimizer returned by zeroshard.engine.initialize()")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}")
        self.every = every
        self.client_state = client_state
        self.rank_state = rank_state
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        timeout = self._state.shard_group.timeout
        # Collective: every rank makes the group (see [Note: the snapshots' process group]).
        self._pg = dist.new_group(backend="gloo", timeout=timeout)
        nodes: list[str | None] = [None] * self.world_size
        me = node_key()
        dist.all_gather_object(nodes, me, group=self._pg)
        self.placement = Placement.of([str(n) for n in nodes])
        self.store = NodeStore(job_folder(Path(root)) / me)
        if self.world_size > 1 and not self.placement.spread:
            warn_on_rank0(
                "snapshots: one node only, so replicas live on the same node: they cover a "
                "worker's crash, not the node's loss (the disk checkpoint does)"
            )
        self._copy = HostCopy()
        on_device = self._state.shard_group.device.type == "cuda"
        self._slots = Slots(self.store, self.rank, pin=on_device)
        self._hook = engine_optimizer.register_step_pre_hook(
            lambda *_: self._copy.wait_before_step()
        )
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_resume: Resumed | None = None

    # -- taking ----------------------------------------------------------------------
    def take(self, step: int) -> bool:
        """Snapshot the state as of `step` if `every` divides it; return whether it did.
        Call on every rank at the same steps (collective)."""
        if step % self.every:
            return False
        self.wait()
        # A delayed step in flight is part of this step; the parameters behind it are
        # kept too ([Note: a snapshot of a lagging run] in _contents.py).
        self._state.settle()
        meta, tensors, extra = rank_contents(
            self._model, self._state, step, self.client_state, self.rank_state
        )
        items = _file.file_tensors(tensors, extra)
        planned = _file.plan(
            step, self.rank, self.world_size, meta, items, None if extra is None else extra.text
        )
        final = self.store.path(step, self.rank, self.world_size, OWN)
        slot = self._slots.next(planned.size)
        buf = slot.buf
        _file.fill_header(buf, planned)
        finish = self._copy.start(items, _file.slots(buf, planned))

        def own() -> torch.Tensor:
            finish()
            _file.seal(buf)
            self.store.link(slot.path, final)
            return buf

        self._start(step, own)
        return True

    def _start(self, step: int, own: Callable[[], torch.Tensor]) -> None:
        def work() -> None:
            try:
                self._replicate(step, own())
            except BaseException as e:  # raised on the main thread by wait()
                self._error = e

        self._thread = threading.Thread(target=work, name=f"zeroshard-snapshot-{step}")
        self._thread.daemon = True
        self._thread.start()

    def _replicate(self, step: int, buf: torch.Tensor) -> None:
        """Send this rank's snapshot to its buddy, keep its wards'; then agree the step is
        complete and drop the older ones (see [Note: snapshot lifecycle])."""
        pg, buddy = self._pg, self.placement.buddy[self.rank]
        wards = self.placement.wards(self.rank)
        works: _wire.Works = []
        if buddy is not None:
            works += _wire.send_header(pg, [step, buf.numel()], buddy)
        heads = {}
        for w in wards:
            heads[w], got = _wire.recv_header(pg, 2, w)
            works += got
        _wire.wait(works)
        works = [] if buddy is None else _wire.send_bytes(pg, buf, buddy)
        received = []
        for w, (their_step, size) in ((w, h.tolist()) for w, h in heads.items()):
            if their_step != step:
                raise RuntimeError(
                    f"snapshots: rank {w} sent step {their_step} while this rank took step "
                    f"{step}: call take() with the same steps on every rank"
                )
            final = self.store.path(step, w, self.world_size, REPLICA)
            temp = self.store.temp(final)
            out = _file.mapped(temp, size)
            works += _wire.recv_bytes(pg, out, w)
            received.append((out, temp, final, w))
        _wire.wait(works)
        for out, temp, final, w in received:
            _file.trailer_crc(out, f"the replica of rank {w} at step {step}")
            self.store.commit(temp, final)
        del received, buf
        dist.all_reduce(torch.ones(1), group=pg)  # every rank's copy and replica are in
        self.store.drop(step, before=True)

    def wait(self) -> None:
        """Wait for the snapshot in flight (its copy, file and replica); raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"snapshots: the last snapshot failed: {error}") from error

    # -- restoring --------------------------------------------------------------------
    def resume(self, directory: str | os.PathLike[str]) -> int | None:
        """Restore the newest step every rank's snapshot covers (from this node's memory
        or a peer's), else the newest intact checkpoint under `directory` (one warning
        says how many steps that costs); return the step, None on a fresh start. Call on
        every rank before the first `take` (collective). See [Note: restoring from memory]."""
        self.wait()
        # Fresh slots: the restored step may be linked to one of the old ones.
        self._slots.close()
        self.last_resume, republish = resume(self, Path(directory))
        if republish is not None:
            self._start(self.last_resume.step or 0, republish)
        return self.last_resume.step

    def close(self) -> None:
        """Wait for the snapshot in flight and remove this node's snapshots (a normal end:
        call on every rank). Collective."""
        try:
            self.wait()
        finally:
            self._hook.remove()
            self._slots.close()
            dist.barrier(group=self._pg)  # no rank of the node still writes
            self.store.remove()
            dist.barrier(group=self._pg)  # every node's folder on this host is gone
            self.store.remove_job()
