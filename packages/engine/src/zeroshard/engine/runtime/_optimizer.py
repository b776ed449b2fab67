"""`ZeroOptimizer`: the user's torch optimizer, stepping this rank's master shards.

It is a `torch.optim.Optimizer` (LR schedulers and optimizer hooks work) that shares
`param_groups` and `state` with the wrapped optimizer, whose `params` lists now hold
the master shards instead of the model's parameters (a whole-matrix optimizer's: the
whole parameters this rank owns).
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch

from zeroshard.comm import Group, Handle
from zeroshard.engine.runtime._collectives import gather_shards
from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._grad_destination import by_destination, by_device
from zeroshard.engine.runtime._home import refresh_homes
from zeroshard.engine.runtime._labels import phase
from zeroshard.engine.runtime._loss_scale import LossScaler
from zeroshard.engine.runtime._reduce import GradReducer
from zeroshard.engine.runtime._stepper import StepOutcome, Stepper
from zeroshard.engine.runtime._tensor_parallel import (
    TensorParallel,
    own_path,
    squares_counted_once,
)
from zeroshard.engine.runtime._watch import ADD_PARAM_GROUP, ChangeWatch
from zeroshard.engine.runtime._wire import refresh_wires


class StepHooks(Protocol):
    """What stage 3 does around a step (`_stage3.Stage3Runtime`)."""

    def before_step(self) -> None:
        """Before the optimizer steps (stage 3: check every rank gathered the same units)."""
        ...

    def after_publish(self) -> None:
        """After new shards were published (stage 3: drop the gathered parameters)."""
        ...


def bind_masters(
    inner: torch.optim.Optimizer,
    groups: Sequence[FlatParamGroup],
    whole: Mapping[int, Sequence[torch.Tensor]],
) -> None:
    """Make `inner`'s param group k step what it steps from now on (it keeps its
    hyperparameters): `whole[k]` where a whole-matrix optimizer steps whole parameters in
    its place (`whole/`), else the master shards of the trainable flat groups built from
    its parameters. Once, before the steppers are built on it."""
    for k, pg in enumerate(inner.param_groups):
        pg["params"] = (
            list(whole[k])
            if k in whole
            else [g.master for g in groups if g.trainable and g.key.param_group == k]
        )


def publish_masters(
    groups: Iterable[FlatParamGroup], allgather_bucket_bytes: int, *, uploaded: bool = False
) -> None:
    """Make what forward computes with follow `groups`' masters (stages 1/2 all-gather the
    parameters); `uploaded`: a step rewrote their compute shards already."""
    groups = list(groups)
    # What gathers send follows the masters first: the homes' compute shards where
    # the masters changed outside a step (a load; a step rewrote them itself), then
    # what the wires take from those (fp8's scales).
    if not uploaded:
        refresh_homes(groups)
    refresh_wires(groups)
    # Stages 1/2 all-gather each group's updated shard; at most `allgather_bucket_bytes`
    # of gathers are in flight, which bounds the temporary send buffers.
    inflight: deque[tuple[int, Handle]] = deque()
    pending = 0
    for g in groups:
        handle = g.publish()
        nbytes = 0 if g.sharded else g.param_buffer.nbytes
        inflight.append((nbytes, handle))
        pending += nbytes
        while pending > allgather_bucket_bytes and len(inflight) > 1:
            done, oldest = inflight.popleft()
            oldest.wait()
            pending -= done
    for _, handle in inflight:
        handle.wait()


class ZeroOptimizer(torch.optim.Optimizer):
    """Steps master shards, then publishes them (stages 1/2 all-gather the parameters).

    `stepper` (chosen by `initialize`) steps the masters: on the device, or with CPU
    offload some of them, and so their optimizer state, on the host. `inner` (its
    param groups bound by `bind_masters`) is the user's optimizer, or several of them
    combined (`_optimizers.CombinedOptimizer`). `tensor_parallel` (a device mesh's tp
    dim) makes the clip norm count each element once. `replicate` (hybrid sharding with
    groups on process groups of their own, which cross the replicas: [Note: groups of
    their own beside hybrid sharding and tensor parallelism] in setup/_placement.py) is
    the replicas, over which those groups' norm and fp16's overflow are summed too.
    """

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        groups: Sequence[FlatParamGroup],
        reducer: GradReducer,
        shard_group: Group,
        scaler: LossScaler | None,
        allgather_bucket_bytes: int,
        *,
        stepper: Stepper,
        hooks: StepHooks | None = None,
        tensor_parallel: TensorParallel | None = None,
        replicate: Group | None = None,
        watch: ChangeWatch | None = None,
    ) -> None:
        self.inner = inner
        self.replicate = replicate
        self.watch = watch
        self.tensor_parallel = tensor_parallel
        self.stepper = stepper
        self.hooks = hooks
        self.flat_groups = list(groups)
        self.reducer = reducer
        self.shard_group = shard_group
        self.scaler = scaler
        self.allgather_bucket_bytes = allgather_bucket_bytes
        self._unscaled = False
        self._overflow = False
        # Whether the gradients held are those a step() used (unscaled), until zero_grad.
        self._stepped = False
        # Whether forward computes with the weights from before the masters' last step
        # (a deferred step, published at the next step(): see `lagging`).
        self._lagging = False
        masters = [g.master for g in self.flat_groups if g.trainable]
        # Optimizer.__init__ sets up hooks and bookkeeping; param_groups/state are then
        # replaced by the inner optimizer's own, so both see the same objects.
        super().__init__(masters, dict(inner.defaults))
        self._share_inner()
        # torch's load_state_dict gives the inner optimizer new param_groups and state:
        # share those too, or an LR scheduler on this optimizer would set learning rates
        # the inner one never reads again.
        inner.register_load_state_dict_post_hook(lambda _: self._share_inner())
        self._built = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused once built: see [Note: changes after initialize] in `_watch.py`
        (torch's constructor adds the masters' group through it)."""
        if getattr(self, "_built", False):
            raise ValueError(ADD_PARAM_GROUP)
        super().add_param_group(param_group)

    def _share_inner(self) -> None:
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    # -- gradients -----------------------------------------------------------------------
    def _trainable(self) -> list[FlatParamGroup]:
        return [g for g in self.flat_groups if g.trainable]

    def _grad_shards(self) -> list[torch.Tensor]:
        return [g.home.ensure_grad_shard() for g in self._trainable()]

    def _scale_grads(self, factor: torch.Tensor | float) -> None:
        """Multiply every gradient shard by `factor`, through its destination."""
        for destination, groups in by_destination(self._trainable()):
            destination.scale(groups, factor)

    def _prepare_grads(self) -> None:
        """Reduce what is pending and, under fp16, unscale and agree on overflow (once per step)."""
        self.reducer.reduce_pending()
        if self.scaler is None or self._unscaled:
            return
        shards = self._grad_shards()
        local_bad = torch.zeros(1, device=self.shard_group.device)
        for s in shards:
            bad = (~torch.isfinite(s)).any().float().reshape(1).to(local_bad.device)
            local_bad = torch.maximum(local_bad, bad)
        # Every rank must skip the same steps: take the max of the flags over ranks.
        self.shard_group.all_reduce(local_bad, op="max", label="fp16 overflow check").wait()
        if self.replicate is not None:  # the groups of their own differ on each replica
            self.replicate.all_reduce(local_bad, op="max", label="fp16 overflow check").wait()
        self._overflow = bool(local_bad.item())
        if not self._overflow:
            self._scale_grads(1.0 / self.scaler.scale)
        self._unscaled = True

    @property
    def grad_scale(self) -> float:
        """What the gradient shards hold is the loss's gradient times this: fp16's loss
        scale from backward until clipping or `step()` unscales them, else 1."""
        if self.scaler is None or self._stepped or (self._unscaled and not self._overflow):
            return 1.0
        return self.scaler.scale

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients by their global norm over all shards; return that norm."""
        if norm_type != 2.0:
            raise ValueError(f"only the 2-norm is supported, got norm_type={norm_type}")
        why = self.stepper.clip_refusal()
        if why:
            raise ValueError(why)
        # The norm's upcasts share the delayed step's scratch, and groups that took no
        # gradient in this window may still be stepping.
        self.settle()
        self._prepare_grads()
        # Every group holds a gradient from here on, offloaded ones too: zeros where none
        # arrived in this window, so no norm below reads a host buffer's stale bytes.
        self._grad_shards()
        if self._overflow:
            return torch.tensor(math.inf)
        norms: list[torch.Tensor] = []
        ordered: list[FlatParamGroup] = []
        for destination, groups in by_destination(self._trainable()):
            norms += destination.norms(groups)
            ordered += groups
        if self.replicate is None:
            local = self._squares(norms, ordered)
            self.shard_group.all_reduce(local, label="grad norm").wait()
        else:
            # The shard group's groups are the same on every replica: summed over one.
            # The groups of their own are other values on each: summed over all ranks.
            own = [own_path(g.key.process_group) is not None for g in ordered]
            parts = [
                self._squares(
                    [n for n, o in zip(norms, own, strict=True) if o is alone],
                    [g for g, o in zip(ordered, own, strict=True) if o is alone],
                )
                for alone in (False, True)
            ]
            both = torch.cat(parts)
            self.shard_group.all_reduce(both, label="grad norm").wait()
            self.replicate.all_reduce(both[1:], label="grad norm (groups of their own)").wait()
            local = both[:1] + both[1:]
        total = local.sqrt().reshape(())
        # The same coefficient as torch.nn.utils.clip_grad_norm_, so results match it.
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        self._scale_grads(coef)
        return total

    def _squares(self, norms: list[torch.Tensor], groups: list[FlatParamGroup]) -> torch.Tensor:
        """The sum of the squares of `norms` (`groups`' gradient norms) on this rank, each
        element counted once over the job once summed over its ranks (one-element fp32)."""
        local = torch.zeros(1, dtype=torch.float32, device=self.shard_group.device)
        if self.tensor_parallel is not None:
            local += squares_counted_once(norms, groups, self.tensor_parallel.size).to(local.device)
        else:
            # One sum per device the norms are on.
            for same in by_device(norms).values():
                local += torch.stack(same).square().sum().to(local.device)
        return local

    # -- step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step the master shards, then all-gather the parameters (skipped on fp16 overflow)."""
        if closure is not None:
            raise ValueError("ZeroOptimizer.step does not take a closure")
        if self.watch is not None:
            self.watch.check("optimizer.step()", param_lists=False)
        if self.hooks is not None:
            self.hooks.before_step()
        self.settle()
        if self._lagging:
            # A deferred step's weights (delay_param_update), uploaded while this window
            # computed with the ones before them.
            self._publish(self._trainable(), uploaded=True)
        self._prepare_grads()
        overflow = self._overflow
        self._unscaled = False
        self._overflow = False
        if self.scaler is not None:
            self.scaler.update(overflow)
        if overflow:
            self.reducer.zero_grad()
            return None
        # The gradients held are now unscaled, until zero_grad (see `grad_scale`).
        self._stepped = True
        with phase("zeroshard::optimizer_step"):
            outcome = self.stepper.step()
        if outcome is StepOutcome.PUBLISH:
            self._publish(self._trainable(), uploaded=True)
        else:
            self._lagging = True
        return None

    @contextlib.contextmanager
    def step_in_backward(self) -> Iterator[None]:
        """Step each offloaded group on the CPU as soon as its gradient lands on the host,
        while the backward run inside this block goes on; `step()` after it steps the rest
        and waits only for the tail ([Note: offload step pipeline]).

        The backward must end the accumulation window, and `step()` must follow it with
        nothing in between: no clipping (the global norm needs every gradient first), no
        fp16 loss scaling (its overflow check too). The weights are those of the step
        without it, bit for bit. Stages 2 and 3 with `offload_optimizer`; stage 1 reduces
        at the step, so there is nothing to overlap.
        """
        with self.stepper.step_in_backward(
            stage=self.reducer.stage, loss_scaled=self.scaler is not None
        ):
            yield

    def settle(self) -> None:
        """offload.delay_param_update: wait for the step in flight (the last `step()`'s CPU
        step), so the masters and optimizer state are those of every `step()` so far;
        raises what that step raised. Everything here and in the engine that reads or
        writes them (clipping, state dicts, checkpoints, loads, `full_state_dict`,
        `gathered_parameters`) calls it first; call it before reading `optimizer.state`
        yourself. It publishes nothing: the parameters forward computes with stay one step
        behind until the next `step()`. Without the option there is nothing to wait for."""
        self.stepper.settle()

    def republish(self) -> None:
        """Make every master shard what forward computes with, after it changed in place
        (a load): stage 3 drops what is gathered, stages 1/2 all-gather the parameters."""
        self.settle()
        self._publish(self.flat_groups)

    @property
    def lagging(self) -> bool:
        """Whether forward computes with the trainable parameters as they were before the
        masters' last step, which the next `step()` publishes first (delay_param_update:
        [Note: delayed parameter update])."""
        return self._lagging

    def behind(self) -> dict[int, torch.Tensor]:
        """While `lagging`: this rank's shard of what each trainable group's parameters
        hold (the compute-dtype weights one step behind the masters; views, by group
        index), what `restore_lag` takes back. Empty when nothing lags."""
        if not self._lagging:
            return {}
        return {g.index: g.param_buffer[slice(*g.shard_range)] for g in self._trainable()}

    def restore_lag(self, behind: Mapping[int, torch.Tensor]) -> None:
        """After the masters were restored and published (a snapshot's load): make forward
        compute with `behind` (`behind()` as it was taken) until the next `step()`
        publishes the masters, as the run the snapshot was taken in did. Collective."""
        groups = self._trainable()
        if behind.keys() != {g.index for g in groups}:
            raise ValueError(
                f"restore_lag: shards of flat groups {sorted(behind)}, this optimizer's "
                f"trainable groups are {[g.index for g in groups]}"
            )
        for g in groups:
            # Stages 1/2 only (delay_param_update's): the parameters are `param_buffer`.
            assert not g.sharded
            shard = behind[g.index].to(g.param_buffer.device)
            label = f"lagging params of group {g.index}"
            gather_shards(g.process_group, g.wire, shard, g.param_buffer, label=label).wait()
        self._lagging = True

    def _publish(self, groups: Iterable[FlatParamGroup], *, uploaded: bool = False) -> None:
        """Publish `groups`' masters; `uploaded`: the step rewrote their compute shards."""
        publish_masters(groups, self.allgather_bucket_bytes, uploaded=uploaded)
        self._lagging = False
        if self.hooks is not None:
            self.hooks.after_publish()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradient shards (freed by default, as torch's optimizers do)."""
        self.reducer.zero_grad(set_to_none)
        self._stepped = False

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state, master shards and loss scale (same world size only)."""
        self.settle()
        return {
            "inner": self.inner.state_dict(),
            "master": [g.master.detach().clone() for g in self.flat_groups],
            "loss_scaler": None if self.scaler is None else self.scaler.state_dict(),
            "world_size": self.shard_group.size,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore `state_dict()` output taken at the same world size, and re-gather params."""
        self.settle()
        if state_dict.get("world_size") != self.shard_group.size:
            raise ValueError(
                f"optimizer state was saved at world size {state_dict.get('world_size')}, "
                f"this run has {self.shard_group.size}; use zeroshard checkpoints to reshard"
            )
        masters = state_dict["master"]
        if len(masters) != len(self.flat_groups):
            raise ValueError(
                f"optimizer state has {len(masters)} flat groups, this model has "
                f"{len(self.flat_groups)}: was it saved from another model or config?"
            )
        for g, m in zip(self.flat_groups, masters, strict=True):
            if m.shape != g.master.shape:
                raise ValueError(
                    f"flat group {g.index}: saved shard {tuple(m.shape)} != {tuple(g.master.shape)}"
                )
        self.inner.load_state_dict(state_dict["inner"])
        with torch.no_grad():
            for g, m in zip(self.flat_groups, masters, strict=True):
                g.master.copy_(m)
            self._publish(self.flat_groups)
        if self.scaler is not None and state_dict.get("loss_scaler") is not None:
            self.scaler.load_state_dict(state_dict["loss_scaler"])
