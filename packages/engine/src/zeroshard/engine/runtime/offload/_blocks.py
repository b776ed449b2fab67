"""The loop of the blocked host step over one offloaded group.

[Note: blocked step loop]
A 7B model's step is ~7000 blocks ([Note: blocked host step] in _fused_adam.py), each an
upcast, torch's fused kernel and the upload told that its masters are final (with
offload_params, their cast into the host shards), so what a block costs besides its
kernels shows in the step: slicing the master and each state tensor, building the
kernel's lists, finding the block's chunk. The kernel's lists for every block of a
group (detached views of its master and state) are made once and kept while those are
the tensors in the optimizer state. A state dict loaded into the optimizer brings new
ones: `forget` drops the views then, so they never keep the old state's memory alive,
and a state replaced any other way is caught by the identity check at the next step.

A group's blocks are stepped on one thread. On several at once (each its own upcast and
share of the cores) each thread's OpenMP team beside the others' makes libgomp throttle
its idle threads ([Note: host step threads] in _threads.py), and the step is slower, not
faster (docs/benchmarks.md, design-measurements).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from zeroshard.engine.runtime.offload._fused_adam import STEP_BLOCK, FusedAdam

# The state tensors the kernel steps beside the master (the last with amsgrad only).
_STATE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")

Written = Callable[[int, int, torch.Tensor], None]


class _Block(NamedTuple):
    """One block of a group: its range and the kernel's lists of views for it."""

    lo: int
    hi: int
    params: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    max_exp_avg_sqs: list[torch.Tensor]


def _blocks_of(tensors: Sequence[torch.Tensor], amsgrad: bool) -> list[_Block]:
    flat = [t.detach().view(-1) for t in tensors]
    n = flat[0].numel()
    out = []
    for lo in range(0, n, STEP_BLOCK):
        hi = min(n, lo + STEP_BLOCK)
        master, avg, avg_sq = ([t[lo:hi]] for t in flat[:3])
        out.append(_Block(lo, hi, master, avg, avg_sq, [flat[3][lo:hi]] if amsgrad else []))
    return out


class BlockedStep:
    """Steps offloaded groups block by block, keeping each group's views between steps."""

    def __init__(self) -> None:
        # Per group: the tensors the views are of (identity-checked) and its blocks.
        self._views: dict[int, tuple[tuple[torch.Tensor, ...], list[_Block]]] = {}

    def forget(self) -> None:
        """The optimizer's state is about to be replaced: drop the views of the old one."""
        self._views.clear()

    def step(
        self,
        key: int,
        adam: FusedAdam,
        state: dict[str, Any],
        master: torch.Tensor,
        grad: torch.Tensor,
        factors: Sequence[torch.Tensor | float],
        scratch: tuple[torch.Tensor, torch.Tensor | None],
        written: Written,
    ) -> None:
        """Step `master` (with `state`, its step count advanced) on `grad`, in its reduce
        dtype with `factors` still to apply, or fp32 with them applied; `scratch` is the
        fp32 upcast (one block) and, for bf16 masters, its cast back to their dtype; after
        each block `written(lo, hi, master)`."""
        names = _STATE[: 3 if adam.amsgrad else 2]
        tensors = (master, *(state[k] for k in names))
        cached = self._views.get(key)
        if cached is None or any(a is not b for a, b in zip(cached[0], tensors, strict=True)):
            cached = self._views[key] = (tensors, _blocks_of(tensors, adam.amsgrad))
        blocks = cached[1]
        _run(blocks, adam, state["step"], grad.view(-1), factors, scratch, written)


def _run(
    blocks: Sequence[_Block],
    adam: FusedAdam,
    step: torch.Tensor,
    grad: torch.Tensor,
    factors: Sequence[torch.Tensor | float],
    scratch: tuple[torch.Tensor, torch.Tensor | None],
    written: Written,
) -> None:
    """Step `blocks` one after another ([Note: blocked step loop]); the kernel takes the
    gradient in the master's dtype (fp32, or bf16 with bf16 masters)."""
    steps, options = [step], adam.options
    upcast, narrow_scratch = scratch
    master = blocks[0].params[0].dtype if blocks else torch.float32
    narrow = grad.dtype != torch.float32
    # bf16 masters step on a bf16 gradient: the upcast (its factors applied) cast to it,
    # or the gradient itself where it needs neither.
    as_is = grad.dtype == master and not factors
    cast = None if master == torch.float32 or as_is else narrow_scratch
    assert cast is not None or master == torch.float32 or as_is
    # No autograd: this may run on a thread of its own, where grad mode is on.
    with torch.no_grad():
        for b in blocks:
            g = grad[b.lo : b.hi]
            if narrow and not as_is:
                # Clipping / unscaling factors in the upcast ([Note: offload host memory]).
                g = upcast[: b.hi - b.lo].copy_(g)
                for f in factors:
                    g.mul_(f)
            if cast is not None:
                g = cast[: b.hi - b.lo].copy_(g)
            adam.kernel(
                b.params, [g], b.exp_avgs, b.exp_avg_sqs, b.max_exp_avg_sqs, steps, **options
            )
            # The block's master is final: the upload may take it (with offload_params its
            # cast into the host shards is written now, while it is in cache).
            written(b.lo, b.hi, b.params[0])
