"""Activation memory, measured by running one micro-batch on the meta device.

[Note: measuring on meta]
The model runs forward and backward with meta tensors (shapes and dtypes, no memory),
seen as fake tensors (FakeTensorMode), under a dispatch mode that counts the bytes of
every storage an operator creates and frees it when the storage dies (a weak reference
expires). Activation checkpointing, the
loss, the saved tensors and the gradient transients are all whatever the model really
does: nothing about the architecture is assumed. Two things differ from a GPU run and are
corrected here: `scaled_dot_product_attention` on meta takes the math path (it would
materialize the seq x seq scores), so without a mask it is routed to the flash-attention
kernel (a CUDA device picks flash or memory-efficient attention, a CPU its own flash
kernel: none keeps the scores); and the engine's gradient path (stage 2/3 buckets and fp32
shards, freeing each full gradient as it is copied) is laid over the trace (`GradPath`)
so the backward peak sees the shards grow as the activations shrink.

The operators' bytes do not depend on the config beyond the compute dtype: every full
gradient is freed as it arrives whatever the stage. So one run gives an `OperatorTrace`
(the bytes when each gradient arrived, the most bytes between arrivals) and each config's
gradient path is replayed on it without running the model again: the planner's
recommendation estimates a dozen configs on one trace.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.planner._groups import GroupPlan, reduce_dtype_bytes
from zeroshard.engine.runtime._home import HomeKind
from zeroshard.engine.runtime._names import named_parameters

LossFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class OperatorTrace:
    """The bytes operators hold during one forward and backward of one micro-batch (each
    full gradient freed as it arrives), cut at each gradient's arrival."""

    micro_batch: int
    seq_len: int
    dtype: torch.dtype
    arrivals: tuple[tuple[str, int], ...]
    """In arrival order: (parameter name, bytes held when its gradient arrived)."""
    between: tuple[int, ...]
    """The most bytes held after each operator between two arrivals (before the first,
    ..., after the last): one more entry than `arrivals`."""


class _LiveBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the bytes of storages created by operators while they are alive, and the
    most of them since the last `cut`."""

    def __init__(self, existing: list[torch.Tensor]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        # Views of tensors that existed before (parameters, the input) allocate nothing.
        self._existing = {StorageWeakRef(t.untyped_storage()).cdata for t in existing}  # type: ignore[no-untyped-call]
        self.current = 0
        self.peak = 0  # since the last cut

    def cut(self) -> int:
        """The most bytes held since the last cut; start counting anew."""
        peak, self.peak = self.peak, 0
        return peak

    def sweep(self) -> None:
        """Forget the storages that died since the last operator."""
        dead = [k for k, (ref, _) in self._live.items() if ref.expired()]  # type: ignore[no-untyped-call]
        for k in dead:
            self.current -= self._live.pop(k)[1]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.sweep()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ref = StorageWeakRef(storage)  # type: ignore[no-untyped-call]
                if ref.cdata not in self._live and ref.cdata not in self._existing:
                    self._live[ref.cdata] = (ref, storage.nbytes())
                    self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out


class GradPath:
    """Replays the engine's gradient path on an `OperatorTrace`, one gradient at a time.

    Stage 2/3: a group's bucket (padded, reduce dtype) appears at its first gradient; when
    the group is complete its fp32 shard appears (on the device unless offloaded) and the
    bucket lives on until `max_inflight_reductions` later groups were launched. Stage 1
    accumulates into the grad buffer counted with the model states. Each full gradient is
    freed once it is copied, as the engine's hook does (the trace already saw that). One
    instance replays one trace.
    """

    def __init__(self, plan: GroupPlan, cfg: ZeroConfig):
        self.stage, self.limit = cfg.stage, cfg.comm.max_inflight_reductions
        self.group_of: dict[str, int] = {}
        for g in plan.groups:
            for s in g.layout.slots:
                self.group_of[s.name] = g.index
        self.plan = plan
        self.remaining = {g.index: len(g.layout.slots) for g in plan.groups if g.trainable}
        self.started: set[int] = set()
        self.inflight: deque[int] = deque()
        self.bucket_bytes = reduce_dtype_bytes(cfg)

    def on_grad(self, name: str) -> list[int]:
        """The bytes the engine allocates (or frees, negative) as `name`'s gradient arrives,
        in order."""
        if self.stage == 1 or name not in self.group_of:
            return []
        g = self.plan.groups[self.group_of[name]]
        out = []
        if g.index not in self.started:
            self.started.add(g.index)
            out.append(g.layout.padded_numel * self.bucket_bytes)
        self.remaining[g.index] -= 1
        if self.remaining[g.index] == 0:
            if g.home is HomeKind.DEVICE:
                out.append(g.layout.shard_numel * 4)
            self.inflight.append(g.index)
            while len(self.inflight) > self.limit:
                retired = self.plan.groups[self.inflight.popleft()]
                out.append(-retired.layout.padded_numel * self.bucket_bytes)
        return out

    def peak(self, trace: OperatorTrace) -> int:
        """The most bytes of operators and gradient path together over the trace (the
        buckets still in flight at the end only shrink the total)."""
        peak = held = 0  # held: the gradient path's bytes
        for (name, at_arrival), before in zip(trace.arrivals, trace.between, strict=False):
            peak = max(peak, before + held)
            for nbytes in self.on_grad(name):
                held += nbytes
                peak = max(peak, at_arrival + held)
        return max(peak, trace.between[-1] + held)


def _flash_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """SDPA as a fused kernel runs it without a mask: output and log-sum-exp, no scores."""
    if attn_mask is not None:
        return _SDPA(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if enable_gqa and k.shape[1] != q.shape[1]:
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    out: torch.Tensor = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, dropout_p, is_causal, scale=scale
    )[0]
    return out


_SDPA = F.scaled_dot_product_attention


@contextlib.contextmanager
def _flash_attention() -> Iterator[None]:
    # Models look `F.scaled_dot_product_attention` up at call time, the recomputation of
    # a checkpointed block included (a mode would not reach the backward's recompute).
    F.scaled_dot_product_attention = _flash_sdpa  # type: ignore[assignment]
    try:
        yield
    finally:
        F.scaled_dot_product_attention = _SDPA


def default_loss(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of a language model called as `model(idx)` (or HF-style)."""
    out = model(idx)
    logits = getattr(out, "logits", out)
    if not isinstance(logits, torch.Tensor):
        raise ValueError(
            f"the model returned {type(out).__name__}: pass loss_fn=(model, idx) -> loss"
        )
    if logits.dim() == 0:
        return logits
    return F.cross_entropy(logits.flatten(0, 1).float(), idx.flatten())


def trace_operators(
    model: nn.Module, micro_batch: int, seq_len: int, loss_fn: LossFn
) -> OperatorTrace:
    """One forward and backward of `model` (on the meta device, in the dtype its
    parameters have) on `micro_batch` x `seq_len` token ids; see [Note: measuring on meta]."""
    if any(not p.is_meta for p in model.parameters()):
        raise ValueError(
            "estimate() needs the model on the meta device (build it under "
            "`with torch.device('meta'):`)"
        )
    # Fake tensors over the meta ones: models that branch on data (Hugging Face's mask
    # checks) take their tracing path instead of calling .item() on a meta tensor.
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    idx = fake.from_tensor(torch.zeros(micro_batch, seq_len, dtype=torch.long, device="meta"))
    # The converter memoizes: these are the very fakes the operators will see.
    existing = [fake.from_tensor(t) for t in (*model.parameters(), *model.buffers())]
    live = _LiveBytes([*existing, idx])
    arrivals: list[tuple[str, int]] = []
    between: list[int] = []

    def arrived(name: str) -> Callable[[torch.Tensor], None]:
        def on_grad(p: torch.Tensor) -> None:
            p.grad = None  # the engine's hook frees each full gradient once it is copied
            between.append(live.cut())
            arrivals.append((name, live.current))

        return on_grad

    handles, seen = [], set()
    for name, p in named_parameters(model):
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            handles.append(p.register_post_accumulate_grad_hook(arrived(name)))  # type: ignore[no-untyped-call]
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    try:
        with _flash_attention(), fake, live:
            loss = loss_fn(model, idx)
            loss.backward()  # type: ignore[no-untyped-call]
    finally:
        for h in handles:
            h.remove()
    between.append(live.cut())
    return OperatorTrace(micro_batch, seq_len, dtype, tuple(arrivals), tuple(between))
