"""`Snapshots`: every rank's state in host memory every N steps, with a replica on
another node, to restart from after a worker or a node is lost.

[Note: snapshot lifecycle]
`take(step)`, on every rank at the same steps:
1. The slot it writes into is waited for: one of its two slots in the node's shared
   memory ([Note: slots], [Note: a node's folder]), free once the snapshot before is
   complete (the one before that is then unneeded); a background error is raised here.
2. On the calling thread: the rank's contents (`rank_contents`: what a checkpoint
   holds) laid out in that slot; host tensors are copied into it now, device tensors
   start their copy on a side stream ([Note: the copy and the next step]); the host
   never waits for the device to drain (nor for the scalars held as tensors: [Note:
   scalars without a sync] in _scalars.py). Training goes on. (The next `take` waits
   for an entry's copy: the device memory of the gradients it reads is held until then.)
3. A background thread writes the header (once those scalars are on the host), seals
   the bytes (crc32c, as the copy arrives) and links them into place: the rank's own
   copy. Then, after the snapshots before ([Note: snapshots in the background]), it
   sends the bytes to the rank's buddy and receives its wards' ([Note: the snapshots'
   process group]), each sealed file renamed into place: the replicas. An all-reduce
   then says every rank's copy and replica of step S are in place: S is complete, and
   each rank removes the older steps of its node (a rank removes only once every rank
   finished S, so a step is held until a newer one is complete).
A node thus holds at most two steps: the newest complete one and the one in flight.
With `full_every=K` the steps between full snapshots take journal entries instead
([Note: the gradient journal] in _journal.py): written, sealed and replicated the same
way into a ring of K slots of their own (their replicas too: [Note: the replicas' ring]
in _replicas.py), and removed only once a newer full snapshot is complete; every rank
agrees at each `take` whether it is an entry or a full snapshot.
An entry's slot is free once the full snapshot after its old entry is complete: with K
slots, an entry waits for the full snapshot before it only from the second entry after
it, so the full snapshot's background work overlaps the next steps.
A kill at any point leaves at worst '.'-named files (never listed) and a step that is
not complete; `resume` ([Note: restoring from memory]) finds what is whole.
"""

from __future__ import annotations

import os
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.ckpt import CheckpointMeta
from zeroshard.comm import warn_on_rank0
from zeroshard.engine.recovery import _file, _wire
from zeroshard.engine.recovery._background import Background
from zeroshard.engine.recovery._contents import object_group, rank_contents
from zeroshard.engine.recovery._host_copy import HostCopy, Ready
from zeroshard.engine.recovery._journal import JournalStep, entry_contents
from zeroshard.engine.recovery._places import Placement, job_folder, node_key
from zeroshard.engine.recovery._replicas import Replicas
from zeroshard.engine.recovery._restore import Resumed, resume
from zeroshard.engine.recovery._room import Need, check_room, free_bytes
from zeroshard.engine.recovery._scalars import Scalars
from zeroshard.engine.recovery._slots import Slot, Slots
from zeroshard.engine.recovery._store import ENTRY, OWN, NodeStore
from zeroshard.engine.runtime._state import EngineModel, engine_module, engine_state
from zeroshard.engine.state._checkpoint import check_same_call, every_rank


class Snapshots:
    """Snapshots of every rank's state in host memory, replicated to another node.

    Call on every rank after `initialize`, with the same `every` and `full_every`
    (collective: a difference is a ValueError on every rank); `resume(directory)` instead of
    `resume_checkpoint` on start, `take(step)` where a checkpoint would be saved (after
    the step, the scheduler and the data position), `close()` at the end.
    `every`: `take` snapshots the steps it divides. `full_every` (with `every=1`): a
    full snapshot every `full_every` steps, a journal entry of the step's gradients at
    each step between ([Note: the gradient journal] in _journal.py); 1, the default:
    full snapshots only. `client_state` / `rank_state` are
    the mappings `save_checkpoint` takes, read at each snapshot. `root`: where the
    shared memory is (`/dev/shm`; the job's folder goes under it). Host memory per
    rank: docs/reliability.md, "Recovery from memory"; `zeroshard-plan --snapshots`. A
    node whose shared memory cannot hold its snapshots is a ValueError on every rank,
    here or at the first `take` ([Note: room in shared memory] in _room.py).
    """

    def __init__(
        self,
        model: EngineModel,
        optimizer: torch.optim.Optimizer,
        *,
        every: int = 1,
        full_every: int = 1,
        client_state: MutableMapping[str, Any] | None = None,
        rank_state: MutableMapping[str, Any] | None = None,
        root: str | os.PathLike[str] = "/dev/shm",
    ) -> None:
        self._model = engine_module(model)
        self._state = engine_state(self._model)
        engine_optimizer = self._state.needs_optimizer("Snapshots")
        # First: a journal on some ranks only would meet the others' collectives with
        # its own (the room check against the restore's inventory), each misread.
        fields = [("every", repr(every)), ("full_every", repr(full_every))]
        check_same_call(every_rank(self._state), "Snapshots", "Snapshots", fields)
        if optimizer is not engine_optimizer:
            raise ValueError("pass the optimizer returned by zeroshard.engine.initialize()")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}")
        if isinstance(full_every, bool) or not isinstance(full_every, int) or full_every < 1:
            raise ValueError(f"full_every must be a positive int, got {full_every!r}")
        if full_every > 1 and every != 1:
            raise ValueError(
                f"full_every={full_every} needs every=1 (got every={every}): a journal entry "
                "holds one step, and a restore replays every step since the full snapshot"
            )
        self.every = every
        self.full_every = full_every
        self.client_state = client_state
        self.rank_state = rank_state
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        timeout = self._state.shard_group.timeout
        # Collective: every rank makes the group (see [Note: the snapshots' process group]).
        self._pg = dist.new_group(backend="gloo", timeout=timeout)
        # Where `take` agrees on an entry or a full snapshot while the threads use `_pg`.
        self._agree_pg = dist.new_group(backend="gloo", timeout=timeout)
        # Where `take` gathers the metadata's objects (groups of their own, a whole-matrix
        # optimizer's state) without waiting for the device, whatever training's backend.
        self._objects = object_group(self._state, self._agree_pg)
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
        self._root = Path(root)
        self._check_room()  # before any file is made
        self._copy = HostCopy()
        on_device = self._state.shard_group.device.type == "cuda"
        self._slots = Slots(self.store, self.rank, pin=on_device)
        self._journal: JournalStep | None = None
        # The newest full snapshot taken since the start or the last resume, the last step.
        self._full: int | None = None
        self._last: int | None = None
        if full_every > 1:
            self._journal = JournalStep(engine_optimizer.stepper, engine_optimizer)
            engine_optimizer.stepper = self._journal
            self._entries = Slots(self.store, self.rank, on_device, full_every, "e")
        # The step each entry slot holds, and the entries taken (the next one's slot).
        self._ring: list[int | None] = [None] * full_every
        self._entry_no = 0
        self._replicas = Replicas(
            self.store, self.rank, self.placement.wards(self.rank), full_every
        )
        # The last entry's device copy: its gradients' memory is held until it is done.
        self._entry_copy: Ready | None = None
        self._hook = engine_optimizer.register_step_pre_hook(lambda *_: self._before_step())
        self._work = Background()
        self.last_resume: Resumed | None = None

    def _check_room(self, full: int | None = None, more: int = 0) -> None:
        """ValueError on every rank unless each node's shared memory holds its snapshots
        ([Note: room in shared memory] in _room.py), a full snapshot this rank's `full`
        bytes (None: a bound from below, its masters and buffers), a journal entry its
        trainable masters, buffers and `more` bytes. Collective."""
        groups = self._state.groups
        buffers = sum(b.nbytes for b in self._model.buffers())
        when = "as the first snapshot lays it out"
        if full is None:
            full = sum(g.master.nbytes for g in groups) + buffers
            when = "its masters and buffers: the optimizer's state counted at the first snapshot"
        entry = 0
        if self.full_every > 1:
            entry = sum(g.master.nbytes for g in groups if g.trainable) + buffers + more
        everyone: list[Any] = [None] * self.world_size
        need = Need(full, entry, free_bytes(self._root))
        dist.all_gather_object(everyone, need, self._agree_pg)
        needs = [Need(*n) for n in everyone]
        check_room(self.placement, needs, self.full_every, self._root, when)

    def _before_step(self) -> None:
        self._copy.wait_before_step()
        if self._journal is not None:
            self._journal.steps += 1

    # -- taking ----------------------------------------------------------------------
    def take(self, step: int) -> bool:
        """Snapshot the state as of `step` if `every` divides it; return whether it did.
        Call on every rank at the same steps (collective). With `full_every`, a journal
        entry where one can be taken, else a full snapshot."""
        if step % self.every:
            return False
        self._work.raise_error()
        if self._entry_copy is not None:  # bounds the gradients' memory held for copies
            self._entry_copy(None)
            self._entry_copy = None
        # A delayed step in flight is part of this step; the parameters behind it are
        # kept too ([Note: a snapshot of a lagging run] in _contents.py), or, after an
        # entry, made again by the replay ([Note: the gradient journal] in _journal.py).
        self._state.settle()
        last, self._last = self._last, step
        if self._journal is not None and self._take_entry(step, last):
            return True
        if self._full is not None:
            self._work.wait_complete(self._full)  # the other slot's step is then unneeded
        self._full = step
        scalars = Scalars()  # [Note: scalars without a sync] in _scalars.py
        meta, tensors, extra = rank_contents(
            self._model,
            self._state,
            step,
            self.client_state,
            self.rank_state,
            scalars.defer,
            self._objects,
        )
        items = _file.file_tensors(tensors, extra)
        text = None if extra is None else extra.text
        room = self._slots.room()
        planned = _file.plan(step, self.rank, self.world_size, meta, items, text, room=room)
        if room is None:  # the first since the start or a resume, on every rank alike
            # An entry holds the user's state and buffers too, and a header of 64 KiB.
            user = 0 if extra is None else sum(t.nbytes for t in extra.tensors.values())
            self._check_room(planned.size, user + (1 << 16))
        final = self.store.path(step, self.rank, self.world_size, OWN)
        slot = self._slots.next(planned.size)
        self._write(step, slot, planned, items, scalars, meta, None, final)
        return True

    def _write(
        self,
        step: int,
        slot: Slot,
        planned: _file.Planned,
        items: dict[str, torch.Tensor],
        scalars: Scalars,
        meta: CheckpointMeta | None,
        record: dict[str, Any] | None,
        final: Path,
        ring: int | None = None,
    ) -> None:
        """Copy a snapshot (`meta`) or journal entry (`record`, at place `ring` of the
        ring) into `slot`; in the background write its header once its deferred scalars
        are on the host, seal it, link it in place as `final`, and replicate it."""
        buf = slot.buf
        values = self._copy.fetch(scalars.tensors)  # ahead of the tensors' copies
        entry = record is not None
        finish = self._copy.start(items, _file.slots(buf, planned), before_step=not entry)
        if entry:
            self._entry_copy = finish

        def own() -> torch.Tensor:
            header = planned
            if scalars.tensors:
                got = values()
                header = _file.resolved(
                    planned, scalars.resolve(meta, got), scalars.resolve(record, got)
                )
            _file.fill_header(buf, header)
            _file.seal(buf, finish)
            self.store.link(slot.path, final)
            return buf

        self._start(step, own, entry, ring)

    def _take_entry(self, step: int, last: int | None) -> bool:
        """Take a journal entry of `step` if every rank can; return whether they did."""
        assert self._journal is not None
        opt = self._state.needs_optimizer("Snapshots.take")
        due = self._full is None or last != step - 1 or step - self._full >= self.full_every
        scalars = Scalars()
        contents = entry_contents(
            self._journal,
            self._model,
            opt,
            self.client_state,
            self.rank_state,
            skip=due,
            scalar=scalars.defer,
        )
        able = torch.tensor([0 if due or isinstance(contents, str) else 1])
        if self.world_size > 1:
            dist.all_reduce(able, op=dist.ReduceOp.MIN, group=self._agree_pg)
        if not able.item():
            if not due:
                why = contents if isinstance(contents, str) else "another rank's cannot"
                warn_on_rank0(f"snapshots: step {step} is snapshotted in full, no entry: {why}")
            return False
        assert not isinstance(contents, str) and self._full is not None
        record, tensors, extra = contents
        items = _file.file_tensors(tensors, extra)
        text = None if extra is None else extra.text
        k, self._entry_no = self._entry_no % self.full_every, self._entry_no + 1
        room = self._entries.room(k)
        planned = _file.plan(
            step, self.rank, self.world_size, None, items, text, record, pad=1 << 16, room=room
        )
        final = self.store.path(step, self.rank, self.world_size, ENTRY)
        old = self._ring[k]
        if old is not None:
            self._work.wait_complete(old + 1)  # a full snapshot after it: it is unneeded
        self._ring[k] = step
        slot = self._entries.at(k, planned.size)
        # The side stream's copy keeps the gradients it reads (record_stream).
        self._write(step, slot, planned, items, scalars, None, record, final, k)
        return True

    def _start(
        self,
        step: int,
        own: Callable[[], torch.Tensor],
        entry: bool = False,
        ring: int | None = None,
    ) -> None:
        self._work.start(step, own, lambda buf: self._replicate(step, buf, entry, ring))

    def _replicate(self, step: int, buf: torch.Tensor, entry: bool, ring: int | None) -> None:
        """Send this rank's snapshot (or journal `entry`, at place `ring` of the entries'
        ring) to its buddy, keep its wards' ([Note: the replicas' ring] in _replicas.py);
        then agree the step is complete and, after a full snapshot, drop the older steps
        (see [Note: snapshot lifecycle])."""
        pg, buddy = self._pg, self.placement.buddy[self.rank]
        wards = self.placement.wards(self.rank)
        works: _wire.Works = []
        if buddy is not None:
            works += _wire.send_header(pg, [step, buf.numel(), int(entry)], buddy)
        heads = {}
        for w in wards:
            heads[w], got = _wire.recv_header(pg, 3, w)
            works += got
        _wire.wait(works)
        works = [] if buddy is None else _wire.send_bytes(pg, buf, buddy)
        received = []
        for w, (their_step, size, their_entry) in ((w, h.tolist()) for w, h in heads.items()):
            if (their_step, their_entry) != (step, int(entry)):
                raise RuntimeError(
                    f"snapshots: rank {w} sent step {their_step} while this rank took step "
                    f"{step}: call take() with the same steps on every rank"
                )
            out, put = self._replicas.place(step, w, self.world_size, size, entry, ring)
            works += _wire.recv_bytes(pg, out, w)
            received.append((out, put, w))
        _wire.wait(works)
        for out, put, w in received:
            _file.trailer_crc(out, f"the replica of rank {w} at step {step}")
            put()
        del received, buf
        dist.all_reduce(torch.ones(1), group=pg)  # every rank's copy and replica are in
        if not entry:  # entries since the full snapshot before are what this one covers
            self.store.drop(step, before=True)
            self._work.completed(step)

    def wait(self) -> None:
        """Wait for the snapshots in flight (copies, files and replicas); raise an error
        one met."""
        self._work.wait()

    # -- restoring --------------------------------------------------------------------
    def resume(self, directory: str | os.PathLike[str]) -> int | None:
        """Restore the newest step every rank's snapshot covers (from this node's memory
        or a peer's), else the newest intact checkpoint under `directory` (one warning
        says how many steps that costs); return the step, None on a fresh start. Call on
        every rank before the first `take` (collective). See [Note: restoring from memory]."""
        self.wait()
        self._work.reset()
        # Fresh slots: the restored step may be linked to one of the old ones.
        self._slots.close()
        self._replicas.close()
        if self._journal is not None:
            self._entries.close()
            self._journal.taken, self._journal.steps = None, 0
        self._ring, self._entry_no = [None] * self.full_every, 0
        self._full = self._last = None
        self.last_resume, republish = resume(self, Path(directory))
        # The journal goes on from the full snapshot restored, its entries the ring's
        # first (where this run's ring holds them all; else the next take is a full one).
        entries = [r for r in republish if r.entry is not None]
        goes_on = self._journal is not None and len(entries) < self.full_every
        for r in republish:  # back in place, replicated again: [Note: restoring from memory]
            self._start(r.step, r.own, r.entry is not None, r.entry if goes_on else None)
        if republish and goes_on:
            self._full, self._last = republish[0].step, republish[-1].step
            for k, r in enumerate(entries):
                self._ring[k] = r.step
            self._entry_no = len(entries)
        return self.last_resume.step

    def close(self) -> None:
        """Wait for the snapshot in flight and remove this node's snapshots (a normal end:
        call on every rank). Collective."""
        try:
            self.wait()
        finally:
            self._hook.remove()
            self._slots.close()
            self._replicas.close()
            if self._journal is not None:
                self._entries.close()
                self._state.needs_optimizer("Snapshots.close").stepper = self._journal.inner
            dist.barrier(group=self._pg)  # no rank of the node still writes
            self.store.remove()
            dist.barrier(group=self._pg)  # every node's folder on this host is gone
            self.store.remove_job()
