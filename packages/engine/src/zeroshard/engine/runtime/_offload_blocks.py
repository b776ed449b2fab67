"""The loop of the blocked host step over one offloaded group, on one thread or several.

[Note: blocked step loop]
A 7B model's step is ~7000 blocks ([Note: blocked host step] in _host_adam.py), each an
upcast, torch's fused kernel and a cast for the upload, so what a block costs besides its
kernels shows in the step: slicing the master and each state tensor, building the
kernel's lists, finding the chunk of the cast. The kernel's lists for every block of a
group (detached views of its master and state) are made once and kept while those are
the tensors in the optimizer state. A state dict loaded into the optimizer brings new
ones: `forget` drops the views then, so they never keep the old state's memory alive,
and a state replaced any other way is caught by the identity check at the next step.

With `STEP_THREADS` > 1 a group's blocks are stepped by that many threads at once, block
k by thread k % STEP_THREADS, each with its own fp32 upcast and an equal share of the
cores for torch's kernels: one thread's Python between kernels, and each kernel's
fork and join, then run while the other threads' kernels do. Every element still goes
through the same kernel on the same inputs, so the bits do not depend on the thread
count. The upload's bookkeeping is not thread-safe: its `written` calls hold a lock. So
that the casts do not queue for it, each thread casts its block into its own scratch first
(as the compute dtype, over the fp32 gradient the kernel has consumed), and under the lock
the upload only copies those bytes: the same bits as casting into the slot.

torch takes a thread's intra-op thread count (OpenMP's, per thread) from the process-wide
one on the thread's first parallel op, and `set_num_threads` sets both. So each stepping
thread asks for its count first (taking the process-wide one) before setting its share,
and once all have, the thread that started them sets the process-wide count back to its
own: threads started later (the gradient worker, the user's) get what they would have got.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

from zeroshard.engine.runtime._host_adam import STEP_BLOCK, FusedAdam

# Threads stepping a group's blocks at once ([Note: blocked step loop]): one until a
# measurement on a GPU host (16 cores) shows more to be faster.
STEP_THREADS = 1

# Seconds to wait for the stepping threads to start: a failure to start is an error, not a
# hang.
_START_TIMEOUT_S = 60.0

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

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # Per group: the tensors the views are of (identity-checked) and its blocks.
        self._views: dict[int, tuple[tuple[torch.Tensor, ...], list[_Block]]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

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
        upcast: torch.Tensor,
        written: Written,
        compute_dtype: torch.dtype,
    ) -> None:
        """Step `master` (with `state`, its step count advanced) on `grad`, in its reduce
        dtype with `factors` still to apply, or fp32 with them applied; `upcast` is the
        scratch (STEP_THREADS blocks of fp32); after each block `written(lo, hi, src)`,
        `src` its master or (on several threads) their cast to `compute_dtype`."""
        names = _STATE[: 3 if adam.amsgrad else 2]
        tensors = (master, *(state[k] for k in names))
        cached = self._views.get(key)
        if cached is None or any(a is not b for a, b in zip(cached[0], tensors, strict=True)):
            cached = self._views[key] = (tensors, _blocks_of(tensors, adam.amsgrad))
        blocks = cached[1]
        grad = grad.view(-1)
        if STEP_THREADS == 1 or len(blocks) == 1:
            _run(blocks, adam, state["step"], grad, factors, upcast, written, None)
            return

        def locked(lo: int, hi: int, src: torch.Tensor) -> None:
            with self._lock:
                written(lo, hi, src)

        width = upcast.numel() // STEP_THREADS
        pool = self._workers()
        runs = [
            pool.submit(
                _run,
                blocks[k::STEP_THREADS],
                adam,
                state["step"],
                grad,
                factors,
                upcast[k * width : (k + 1) * width],
                locked,
                compute_dtype,
            )
            for k in range(STEP_THREADS)
        ]
        for run in runs:
            run.result()

    def _workers(self) -> ThreadPoolExecutor:
        """The stepping threads, each with its share of the cores ([Note: blocked step
        loop])."""
        if self._pool is not None:
            return self._pool
        cores = torch.get_num_threads()
        share = max(1, cores // STEP_THREADS)
        started = threading.Barrier(STEP_THREADS + 1, timeout=_START_TIMEOUT_S)

        def start() -> None:
            if self.device.type == "cuda":
                # The uploads it queues go to this rank's device, not device 0.
                torch.cuda.set_device(self.device)
            torch.get_num_threads()  # this thread's count taken from the process-wide one
            torch.set_num_threads(share)

        pool = ThreadPoolExecutor(STEP_THREADS, "zeroshard-offload-block", initializer=start)
        # One task per thread that waits for all: every thread is started before the next.
        waits = [pool.submit(started.wait) for _ in range(STEP_THREADS)]
        started.wait()
        for w in waits:
            w.result()
        torch.set_num_threads(cores)
        self._pool = pool
        return pool


def _run(
    blocks: Sequence[_Block],
    adam: FusedAdam,
    step: torch.Tensor,
    grad: torch.Tensor,
    factors: Sequence[torch.Tensor | float],
    upcast: torch.Tensor,
    written: Written,
    cast: torch.dtype | None,
) -> None:
    """Step `blocks` one after another on this thread; with `cast`, cast each block's
    master into `upcast` as that dtype before `written` ([Note: blocked step loop])."""
    steps, options, narrow = [step], adam.options, grad.dtype != torch.float32
    # No autograd: this may run on a thread of its own, where grad mode is on.
    with torch.no_grad():
        for b in blocks:
            g = grad[b.lo : b.hi]
            if narrow:
                # Clipping / unscaling factors in the upcast ([Note: offload host memory]).
                g = upcast[: b.hi - b.lo].copy_(g)
                for f in factors:
                    g.mul_(f)
            adam.kernel(
                b.params, [g], b.exp_avgs, b.exp_avg_sqs, b.max_exp_avg_sqs, steps, **options
            )
            # The block's master is final: cast it for the upload while it is in cache.
            src = b.params[0]
            if cast is not None:
                src = upcast.view(cast)[: b.hi - b.lo].copy_(src)
            written(b.lo, b.hi, src)
