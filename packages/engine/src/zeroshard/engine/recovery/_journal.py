"""The gradient journal: between two full snapshots, what each optimizer step consumed,
so that a restore replays the steps since the last full snapshot.

[Note: the gradient journal]
With `Snapshots(every=1, full_every=K)` a full snapshot (masters, optimizer state: what a
checkpoint holds) is taken every K steps, and at each step between, a journal entry of
what that step consumed and left beside the state: each trainable flat group's gradient
shard exactly as the stepper read it (reduced, unscaled, clipped, in the master's
dtype), whether the step ran (fp16 skips a step on overflow), the param groups'
hyperparameters it stepped with and those after it (a scheduler changes them), the loss
scale, the module buffers, and the user's state (`client_state`, `rank_state`). A
restore puts the newest full snapshot F back and steps each entry F+1..S through the same
stepper on the same gradients and hyperparameters: the same kernels on the same inputs,
so the masters and optimizer state are those of step S bit for bit; the last entry's
hyperparameters, loss scale, buffers and user state follow.

Recording: `JournalStep` stands in for the optimizer's stepper and keeps a reference to
each gradient shard as `step()` hands it over. An offloaded group's is copied at once: its
host memory is the next window's, and a gradient narrower than fp32 there still has its
clipping and unscaling factors pending, applied as the step reads it; the copy is what
the step reads (`read`, every factor applied, in the master's dtype, as every host step
and a whole-matrix step on the host take it), so a replay puts it back with no factor.
`take` writes the entry. A shard the optimizer dropped (`zero_grad()`, set_to_none: the
default) is only referenced by the journal, so its copy to host memory runs on a side
stream beside the next forward, costing the training stream nothing; a shard still held
by the optimizer at `take` is cloned first on the training stream (the next backward
writes it). A shard written after the step (its version moved:
`zero_grad(set_to_none=False)` before `take`, or an optimizer that writes its gradients)
is no longer what the step read: that step gets a full snapshot. So does a step `take`
is not called after exactly once (the journal holds one step per entry). A group that
took no gradient in the window (no backward ran; unused parameters' reduced gradients
are zeros, so otherwise every group has one) is not stepped by the step: the entry lists
it and the replay leaves it unstepped too.
Under `step_in_backward` the offloaded groups step on the stepping thread as their
gradients land, from staging slots reused once they stepped: the stepping thread records
each one's gradient just before its step reads it (`StepThread.before_each`, the same
copy, every factor applied), and `step()` records the rest (the groups on the device, a
whole-matrix optimizer's, stepped then). Stepping a group in backward and at `step()`
run the same function on the same gradient (`_step_group` in runtime/offload/_step.py,
for torch's per-element optimizers, the only ones stepped in backward), so a replay
steps the entry at `step()`; a replayed host gradient is put back in memory of its own,
not the gradients held between steps, which a run stepping in backward never allocates.

A replay is collective as the steps it repeats were: every rank replays the same entries
in the same order (the plan is the same on every rank), so a stepper's own collectives
(a whole-matrix optimizer's exchanges with the matrices' owners, Muon's joins over tensor
parallelism) meet as they met in training. What a publish derives from the masters (the
fp8 gather's scales, in its wire) is derived again by the replay's one publish after its
last entry; nothing of it is journaled.

Under `offload.delay_param_update` `step()` S publishes the masters of step S - 1 and
starts step S on the stepping thread; `take(S)` waits for it (`settle`), so the state at
S is the masters and optimizer state of every step so far, with forward computing at
the masters of S - 1 ([Note: a snapshot of a lagging run] in _contents.py). An entry
records the gradient at `step()`, as the delayed step reads it (its host copy taken
before the thread starts); the replay steps each entry through the same delayed step
and waits for it (`settle`), publishes the masters of S - 1 before the last entry as
`step()` S did, and leaves them published after it (`restore_lag`): the next `step()`
publishes the masters of S first, as in the uninterrupted run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from zeroshard.ckpt import CheckpointError, RankExtra, buffer_key
from zeroshard.comm import Group
from zeroshard.engine.recovery._contents import checked_user_state
from zeroshard.engine.recovery._file import Snapshot
from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._home import HomeKind
from zeroshard.engine.runtime._optimizer import ZeroOptimizer
from zeroshard.engine.runtime._state import EngineState
from zeroshard.engine.runtime._stepper import StepOutcome, Stepper
from zeroshard.engine.runtime.offload import HostOffload, StepThread
from zeroshard.engine.state._checkpoint_apply import put_hyperparameters, restore_user_state
from zeroshard.engine.state._checkpoint_layout import (
    Scalar,
    checkpoint_group_name,
    module_buffers,
)
from zeroshard.engine.state._user_state import (
    GLOBAL,
    PER_RANK,
    encode_state,
)

_GRAD = "grad."


def _hyper_value(value: Any, scalar: Scalar) -> Any:
    if isinstance(value, (tuple, list)):
        return [_hyper_value(v, scalar) for v in value]
    if isinstance(value, torch.Tensor):
        return scalar(value)
    return value


def hyperparameters(opt: ZeroOptimizer, scalar: Scalar) -> list[dict[str, Any]]:
    """Every param group's hyperparameters, as JSON values (a checkpoint's encoding), a
    tensor's as `scalar` makes it."""
    return [
        {k: _hyper_value(v, scalar) for k, v in pg.items() if k != "params"}
        for pg in opt.param_groups
    ]


def _kept(t: torch.Tensor) -> torch.Tensor:
    """A tensor hyperparameter as it is now, with no sync: a scheduler may change it in
    place before `take` reads it ([Note: scalars without a sync] in _scalars.py)."""
    return t.detach().clone()


class _Step(NamedTuple):
    """What one `step()` handed its stepper: each group's gradient and its version then."""

    grads: dict[str, tuple[FlatParamGroup, torch.Tensor, int]]
    hyper: list[dict[str, Any]]  # a tensor's a copy (`_kept`)
    no_grad: list[str]  # the trainable groups that took no gradient: not stepped


def _as_stepped(g: FlatParamGroup) -> torch.Tensor:
    """An offloaded group's gradient as its step reads it: every factor applied, in the
    master's dtype, a copy (see [Note: the gradient journal])."""
    out = torch.empty_like(g.master.detach())
    for start, block in g.grads.read(g):
        out[start : start + block.numel()].copy_(block)
    return out


class JournalStep:
    """The optimizer's stepper, recording what each `step()` consumes for the journal."""

    def __init__(self, inner: Stepper, opt: ZeroOptimizer) -> None:
        self.inner = inner
        self._opt = opt
        self.taken: _Step | None = None
        self.steps = 0  # step() calls since the last entry (skipped ones too)
        # Under step_in_backward: each group stepped in backward, its gradient as its step
        # read it (recorded on the stepping thread), by group index.
        self._early: dict[int, torch.Tensor] = {}

    def record(self) -> None:
        """Keep this step's gradients and hyperparameters (see [Note: the gradient journal])."""
        grads = {}
        early, self._early = self._early, {}
        for g in self._opt.flat_groups:
            if g.trainable:
                shard = early.get(g.index)
                if shard is None:
                    if g.home.grad_shard is None:
                        # No gradient in this window (an expert no token reached): the
                        # step skips the group, and so will the replay; a zero gradient
                        # here would step it (AdamW's decay and moments would move).
                        continue
                    shard = g.home.grad_shard
                    if g.home.kind is HomeKind.HOST:
                        shard = _as_stepped(g)
                grads[checkpoint_group_name(g)] = (g, shard, shard._version)
        no_grad = [
            checkpoint_group_name(g)
            for g in self._opt.flat_groups
            if g.trainable and checkpoint_group_name(g) not in grads
        ]
        self.taken = _Step(grads, hyperparameters(self._opt, _kept), no_grad)

    def step(self) -> StepOutcome:
        """Record, then step as the stepper does."""
        self.record()
        return self.inner.step()

    def settle(self) -> None:
        """The stepper's."""
        self.inner.settle()

    @contextlib.contextmanager
    def step_in_backward(self, *, stage: int, loss_scaled: bool) -> Iterator[None]:
        """The stepper's, each group it steps in backward recorded just before its step
        reads the gradient (on the stepping thread: [Note: the gradient journal])."""
        threads = {id(t): t for t in _step_threads(self._opt)}.values()
        self._early = {}
        with self.inner.step_in_backward(stage=stage, loss_scaled=loss_scaled):
            for t in threads:
                t.before_each = self._record_early
            try:
                yield
            finally:
                for t in threads:
                    t.before_each = None

    def _record_early(self, g: FlatParamGroup) -> None:
        self._early[g.index] = _as_stepped(g)

    def clip_refusal(self) -> str:
        """The stepper's."""
        return self.inner.clip_refusal()


def _step_threads(opt: ZeroOptimizer) -> list[StepThread]:
    """The threads that step offloaded groups as their gradients land (one per host
    store)."""
    threads = []
    for g in opt.flat_groups:
        store = g.home.store
        if g.home.kind is HomeKind.HOST and isinstance(store, HostOffload):
            threads.append(store.step_thread)
    return threads


def entry_contents(
    journal: JournalStep,
    model: nn.Module,
    opt: ZeroOptimizer,
    client_state: Mapping[str, Any] | None,
    rank_state: Mapping[str, Any] | None,
    *,
    skip: bool = False,
    scalar: Scalar,
) -> tuple[dict[str, Any], dict[str, torch.Tensor], RankExtra | None] | str:
    """This step's journal entry (its record, a tensor hyperparameter's value as `scalar`
    makes it; tensors and user state), or why this step cannot have one (a full snapshot
    then; `skip`: one is due anyway): see [Note: the gradient journal]. Resets the journal
    for the next step."""
    taken, steps = journal.taken, journal.steps
    journal.taken, journal.steps = None, 0
    if skip:
        return "a full snapshot is due"
    if steps != 1:
        return f"{steps} optimizer step(s) since the last snapshot, an entry holds one"
    tensors: dict[str, torch.Tensor] = {}
    if taken is not None:
        for name, (g, shard, version) in taken.grads.items():
            if shard._version != version:
                return f"flat group {g.index}'s gradient was written after the step"
            held = g.home.grad_shard is shard or g.master.grad is shard
            tensors[_GRAD + name] = shard.clone() if held else shard
    for k, v in module_buffers(model).items():
        # Forward may write a buffer while the copy runs: a copy of its own.
        tensors[buffer_key(k)] = v.detach().clone() if v.device.type != "cpu" else v.detach()
    consumed = None
    if taken is not None:
        consumed = [{k: _hyper_value(v, scalar) for k, v in pg.items()} for pg in taken.hyper]
    record = {
        "stepped": taken is not None,
        "no_grad": [] if taken is None else taken.no_grad,
        "consumed": consumed,
        "after": hyperparameters(opt, scalar),
        "loss_scaler": None if opt.scaler is None else opt.scaler.state_dict(),
    }
    extra = encode_state({GLOBAL: client_state, PER_RANK: rank_state})
    return record, tensors, extra


class Entry(NamedTuple):
    """A journal entry checked to fit this engine: its record, gradients by group index,
    buffers, and the user's global and per-rank state."""

    record: Mapping[str, Any]
    grads: dict[int, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    glob: dict[str, Any]
    mine: dict[str, Any]


def check_entry(
    state: EngineState,
    model: nn.Module,
    snap: Snapshot,
    where: str,
    client_state: Mapping[str, Any] | None,
    rank_state: Mapping[str, Any] | None,
) -> Entry:
    """A journal entry's contents, checked to fit this engine (CheckpointError)."""
    record = snap.journal
    if record is None or snap.meta is not None:
        raise CheckpointError(f"{where} is not a journal entry")
    grads = {}
    if record["stepped"]:
        # The groups that took no gradient in the entry's window (older entries: none).
        absent = set(record.get("no_grad", ()))
        for g in state.groups:
            if not g.trainable or checkpoint_group_name(g) in absent:
                continue
            t = snap.tensors.get(_GRAD + checkpoint_group_name(g))
            if t is None or t.dtype != g.master.dtype or t.shape != g.master.shape:
                got = None if t is None else (t.dtype, tuple(t.shape))
                raise CheckpointError(
                    f"{where} holds no gradient of flat group {g.index} as its master is "
                    f"({g.master.dtype}, {tuple(g.master.shape)}; got {got})"
                )
            grads[g.index] = t
    buffers = {}
    for k, v in module_buffers(model).items():
        t = snap.tensors.get(buffer_key(k))
        if t is None or t.shape != v.shape or t.dtype != v.dtype:
            raise CheckpointError(f"{where} holds no buffer {k!r} of this model's shape")
        buffers[k] = t
    glob, mine = checked_user_state(snap, where, client_state, rank_state)
    return Entry(record, grads, buffers, glob, mine)


@torch.no_grad()
def replay(
    model: nn.Module,
    state: EngineState,
    everyone: Group,
    label: str,
    entries: Sequence[Entry],
    client_state: MutableMapping[str, Any] | None,
    rank_state: MutableMapping[str, Any] | None,
) -> None:
    """Step `entries` in order on the state a full snapshot put back, then put back the
    last one's hyperparameters, loss scale, buffers and user state; publish the masters
    (under delay_param_update those of the step before the last, as training did).
    Collective (the stepper's own collectives, the publish)."""
    opt = state.needs_optimizer("Snapshots.resume")
    stepper = opt.stepper.inner if isinstance(opt.stepper, JournalStep) else opt.stepper
    trainable = [g for g in state.groups if g.trainable]
    # Whether forward computes one step behind the masters (delay_param_update: [Note:
    # the gradient journal]), as `ZeroOptimizer.step` tracks it.
    lagging = opt.lagging
    for i, e in enumerate(entries):
        if lagging and i == len(entries) - 1:
            opt.republish()  # what step() S published first: the masters of step S - 1
            lagging = False
        if not e.record["stepped"]:
            continue
        put_hyperparameters(opt.param_groups, e.record["consumed"])
        for g in trainable:
            grad = e.grads.get(g.index)
            if grad is None:
                continue  # no gradient in that window: the step skips it, as it did
            if g.home.kind is HomeKind.HOST:
                # As the step read it (the host step reads any dtype), in no memory held
                # between steps: a run stepping in backward holds none ([Note: offload
                # host memory] in runtime/offload/_host_offload.py).
                g.home.grad_shard = grad.clone()
            else:
                g.home.ensure_grad_shard().copy_(grad)
        lagging = stepper.step() is StepOutcome.DEFERRED
        stepper.settle()
        opt.zero_grad()
    last = entries[-1]
    put_hyperparameters(opt.param_groups, last.record["after"])
    if opt.scaler is not None and last.record["loss_scaler"] is not None:
        opt.scaler.load_state_dict(last.record["loss_scaler"])
    live = module_buffers(model)
    for k, t in last.buffers.items():
        live[k].copy_(t)
    if client_state is not None or rank_state is not None:
        pairs = [(last.glob, client_state or {}), (last.mine, rank_state or {})]
        restore_user_state(everyone, label, pairs)
    if lagging:
        # The masters of step S - 1 published above stay what forward computes with.
        opt.restore_lag({g.index: g.param_buffer[slice(*g.shard_range)].clone() for g in trainable})
    else:
        opt.republish()
