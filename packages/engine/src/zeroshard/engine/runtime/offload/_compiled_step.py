"""Adam/AdamW over an offloaded piece in one compiled pass (`offload.compiled_step`).

[Note: compiled host step]
The blocked step ([Note: blocked host step] in _fused_adam.py) makes passes over each
block, each an OpenMP region of its own: the gradient's upcast, torch's fused kernel and,
with offload_params, the master's cast. The CPU step is bound by memory, and those passes
add traffic and regions. Here inductor compiles the whole update into one loop: the
gradient read in its reduce dtype and scaled by the pending factors, the master and
moments read and written once, and with offload_params the compute-dtype shard written
straight into the host shards (otherwise the device casts the masters: [Note: offload
upload] in _upload.py). That brings the step near torch's fused AdamW alone, which the
blocked step is well behind (docs/benchmarks.md, design-measurements).

The arithmetic is torch's Adam/AdamW (its hyperparameters, bias corrections computed in
double and rounded to fp32, decoupled or L2 weight decay, amsgrad, maximize; its kernel's
order of operations) but not its bits: inductor vectorizes and fuses multiply-adds its
own way (torch's kernel lerps the first moment with a fused multiply-add), and the
factors are applied as their product. So this is an option, not the default: without it
the step is bit for bit torch's. With it every mode (the serial step, `step_in_backward`,
`delay_param_update`) runs this same kernel, and they agree bit for bit.

One compiled loop per variant (Adam or AdamW, amsgrad, maximize; the dtypes are guarded)
with a dynamic length, compiled by `initialize` (`compile_variants`) for the gradient in
the reduce dtype and in fp32 (gradient accumulation's), so a rank without a working C++
compiler fails there on every rank and the first step compiles nothing. Dynamo also
guards the calling thread's intra-op thread count, so it is compiled for the main
thread's and, on a GPU, for the stepping thread's share ([Note: host step threads]):
otherwise the first `step_in_backward` step would recompile on the stepping thread.
Pieces are cut at upload chunks, so each writes within one chunk, and are a chunk long,
so a call's own cost (Dynamo's guards, the coefficients) stays small beside it.

The loop is compiled with inductor's `cpp.dynamic_threads`: it always runs in parallel,
on the team of whichever thread calls it ([Note: host step threads]). Without it
inductor writes the compiling thread's count into the loop, or makes the loop serial
when the length it sees is short for that count, as the few elements `initialize`
compiles on are (docs/benchmarks.md, design-measurements).

The kernel is built with inductor's `cpp_wrapper`, whose entry point releases the GIL
while the loop runs (the default Python binding holds it for the whole call, unlike
torch's own ops). Where it runs on the stepping thread (`delay_param_update`,
`step_in_backward`) the main thread's forward and the autograd thread's backward must
queue their kernels meanwhile. With the GIL held they would queue them only between
pieces, so the forward beside the step would stretch and the stepping thread would wait
for gradients between groups (docs/benchmarks.md, design-measurements); with it released
the step is the CPU step's own length. tests/engine/test_offload_compiled.py checks that
another thread runs during a call. What the step takes in training is in
docs/benchmarks.md, offload-compiled.

Each piece goes in as a tensor over its own slice of its storage (`_alone`): no view
base, offset 0. Passed as views, Dynamo would guard their bases' sizes and offsets and
the equalities it happened to see between them (an offset equal to a length, the first
group's offset 0), and pieces of a later step would recompile. Alone, a piece's length is
the only guard, and one compile serves every length but 1 (Dynamo specializes a length
of 1: such a piece compiles once more). Marking the lengths unbacked instead would remove
even that, but inductor's loop over an unbacked length is much slower on the CPU
(docs/benchmarks.md, design-measurements).

[Note: bf16 masters in the compiled step]
With bf16 masters (`precision.master_dtype`) the same loop reads the bf16 master and
moments and the gradient in its reduce dtype, computes in fp32 and stores each of them
once, rounded to nearest: the arithmetic of torch's fused Adam/AdamW on bf16 parameters
(fp32 opmath; the moments' fp32 values, not their stored bf16 ones, make the update, as
there). The gradient such a step reads is a bf16 parameter's .grad: the gradient times
its pending factors, rounded to bf16 (inductor drops a cast down and back up unless told
to keep it: `emulate_precision_casts`). Every value is torch's fp32 result rounded once,
so a last-bit difference in fp32 shows only where that result lies within it of a bf16
rounding boundary: a few elements in ten thousand differ from torch's by one bf16 step
(tests/engine/test_offload_compiled.py). With offload_params the compute shard is the
master's own bf16 value, written in the same pass. One pass instead of the blocked step's
upcast, narrowing and torch's kernel where the gradient has pending factors or is fp32.

Where no factor is pending and the gradient is in the masters' dtype (bf16 reduced
gradients, no clipping, unscaling or accumulation) it is that .grad already: a loop of
its own (`scaled` off) reads it as it is, with no multiply and no rounding, which would
give back the same bits (a bf16 value times 1, rounded to bf16). Where a core computes
rather than waits on memory that is a third of the loop's time (one AMD EPYC core, 16M
elements: 9.7 ms scaled and rounded, 6.5 ms as it is); where the step is bound by host
memory (all cores of a GPU host) less. `compile_variants` compiles both loops where both
can run, so a step that clips after steps that did not compiles nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from functools import cache
from typing import Any

import torch

from zeroshard.engine.runtime.offload._fused_adam import FusedAdam

# The coefficients, in this order, in one fp32 tensor (torch's fused kernel computes them
# in double and rounds them to the fp32 it steps in).
_DECAY, _AVG, _BETA2, _SQ, _BC2_SQRT, _EPS, _STEP = range(7)


@cache
def _kernel(decoupled: bool, amsgrad: bool, maximize: bool, scaled: bool) -> Callable[..., Any]:
    """The compiled update for one variant (its length dynamic, dtypes guarded); `scaled`
    off: the gradient is in the masters' dtype with no factor pending, read as it is
    ([Note: bf16 masters in the compiled step])."""

    def update(
        master: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        max_exp_avg_sq: torch.Tensor | None,
        out: torch.Tensor | None,
        coef: torch.Tensor,
        scale: torch.Tensor | None,
    ) -> None:
        # Every value in fp32, each stored once ([Note: bf16 masters in the compiled step]).
        g = grad.float()
        if scale is not None:
            g = g * scale
            if master.dtype != torch.float32:
                # The gradient a bf16 parameter's step reads: its .grad, in its dtype.
                g = g.to(master.dtype).float()
        if maximize:
            g = -g
        p = master.float()
        if decoupled:
            p = p * coef[_DECAY]
        else:
            g = g + p * coef[_DECAY]
        avg = exp_avg.float().lerp(g, coef[_AVG])
        avg_sq = exp_avg_sq.float() * coef[_BETA2] + coef[_SQ] * g * g
        exp_avg.copy_(avg)
        exp_avg_sq.copy_(avg_sq)
        second = avg_sq
        if max_exp_avg_sq is not None:
            second = torch.maximum(max_exp_avg_sq.float(), avg_sq)
            max_exp_avg_sq.copy_(second)
        denom = second.sqrt() / coef[_BC2_SQRT] + coef[_EPS]
        p = p + coef[_STEP] * avg / denom
        master.copy_(p)
        if out is not None:
            out.copy_(p)

    # A code object of its own: Dynamo keeps its compiled variants (and their recompile
    # limit) per code object, and the dtypes seen make a few of each.
    name = f"adam_update_{int(decoupled)}{int(amsgrad)}{int(maximize)}{int(scaled)}"
    update.__code__ = update.__code__.replace(co_name=name)
    # dynamic_threads: the loop's team is the calling thread's ([Note: compiled host step]).
    options: dict[str, str | int | bool | Callable[..., Any]] = {
        "cpp.dynamic_threads": True,
        # Its entry point releases the GIL while the loop runs ([Note: compiled host step]).
        "cpp_wrapper": True,
        # Keep the gradient's rounding to bf16 (inductor drops a cast down and back up).
        "emulate_precision_casts": True,
    }
    compiled: Callable[..., Any] = torch.compile(
        update, dynamic=True, fullgraph=True, options=options
    )
    return compiled


def coefficients(adam: FusedAdam, step: float) -> torch.Tensor:
    """The fp32 coefficients of one group's step `step` (counted from 1)."""
    lr = float(adam.lr)
    decay = 1 - lr * adam.weight_decay if adam.kernel is torch._fused_adamw_ else adam.weight_decay
    bc1 = 1 - adam.beta1**step
    bc2 = 1 - adam.beta2**step
    values = [decay, 1 - adam.beta1, adam.beta2, 1 - adam.beta2, math.sqrt(bc2), adam.eps]
    return torch.tensor([*values, -lr / bc1], dtype=torch.float32)


def scale_of(factors: Sequence[torch.Tensor | float]) -> torch.Tensor | None:
    """The pending clipping / unscaling factors as one fp32 factor (their product, in the
    order they came; None with none)."""
    if not factors:
        return None
    scale = torch.ones((), dtype=torch.float32)
    for f in factors:
        scale = scale * f
    return scale


def compile_variants(
    adams: Iterable[FusedAdam],
    grad_dtypes: Iterable[torch.dtype],
    out_dtype: torch.dtype | None,
    thread_counts: Iterable[int],
    master_dtype: torch.dtype = torch.float32,
) -> None:
    """Compile the update of each of `adams`' variants for each gradient dtype and each
    intra-op thread count the step will run with, now, on one piece of zeros: the first
    step then compiles nothing ([Note: compiled host step]). `out_dtype`: the cast the
    step writes (None: it writes none); `master_dtype`: the masters' and moments'."""
    # Inductor tunes its loop to the length it sees here (its hint): a chunk-like one.
    n = 1 << 20
    # One piece for every call: what it holds after a call does not matter, only its
    # dtypes and length (zeros stay finite: the denominator is at least eps).
    master = torch.zeros(n, dtype=master_dtype)
    moments = [torch.zeros(n, dtype=master_dtype) for _ in range(3)]
    grads = [torch.zeros(n, dtype=dtype) for dtype in grad_dtypes]
    out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
    own = torch.get_num_threads()
    try:
        for threads in thread_counts:
            # Dynamo guards the caller's thread count (its global state).
            torch.set_num_threads(threads)
            for adam in adams:
                coef = coefficients(adam, 1.0)
                for grad in grads:
                    # With factors pending and without (the unscaled loop, where it applies).
                    for scale in (scale_of([1.0]), scale_of(())):
                        step_piece(adam, coef, scale, master, grad, moments, out)
    finally:
        torch.set_num_threads(own)


def _alone(t: torch.Tensor) -> torch.Tensor:
    """`t` (1-D, contiguous) as a tensor of its own slice of its storage: no view base,
    offset 0, so Dynamo guards its length alone ([Note: compiled host step])."""
    assert t.dim() == 1 and t.is_contiguous(), "a piece is 1-D and contiguous"
    size = t.element_size()
    start = t.storage_offset() * size
    # The slice holds a reference to the whole storage, as a view would.
    part = t.untyped_storage()[start : start + t.numel() * size]
    return torch.empty(0, dtype=t.dtype).set_(part)


# Grad mode off whatever the caller's: Dynamo guards it, and initialize (which compiles)
# runs with it on, the step without it; a thread's mode is its own.
@torch.no_grad()
def step_piece(
    adam: FusedAdam,
    coef: torch.Tensor,
    scale: torch.Tensor | None,
    master: torch.Tensor,
    grad: torch.Tensor,
    moments: Sequence[torch.Tensor],
    out: torch.Tensor | None,
) -> None:
    """Step `master` (a piece) on `grad` times `scale` (None: no factor pending), with its
    `moments` (exp_avg, exp_avg_sq[, max_exp_avg_sq]), and write its compute-dtype cast to
    `out` if given."""
    # Read as it is: a gradient in the bf16 masters' dtype with no factor pending.
    as_is = scale is None and grad.dtype == master.dtype != torch.float32
    if scale is None and not as_is:
        # fp32 masters (or an fp32 gradient for bf16 ones): the one loop they compile.
        scale = torch.ones((), dtype=torch.float32)
    kernel = _kernel(adam.kernel is torch._fused_adamw_, adam.amsgrad, adam.maximize, not as_is)
    third = _alone(moments[2]) if adam.amsgrad else None
    kernel(
        _alone(master),
        _alone(grad),
        _alone(moments[0]),
        _alone(moments[1]),
        third,
        None if out is None else _alone(out),
        coef,
        scale,
    )
