"""`cast_into`: a copy between float dtypes by the fastest kernel torch has for the pair.

[Note: widening copies]
On CUDA, `dst.copy_(src)` from bf16 or fp16 into fp32 runs torch's generic copy kernel,
which loads and casts one element at a time (`unrolled_elementwise_kernel`), slower than
the multi-tensor copy `_foreach_copy_` runs for the same pair. The fold of the reduced
gradients into the fp32 shards is such a copy of every gradient, every step, so the
difference shows in the step (docs/benchmarks.md, design-measurements). Widening is
exact, so both give the same bits. Narrowing (fp32 into bf16 or fp16) has a vectorized
kernel of its own in `copy_`, faster than the foreach copy, and keeps it.
"""

from __future__ import annotations

import torch


def cast_into(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Copy `src` into `dst` (same shape and device, any float dtypes), widening through
    `_foreach_copy_` ([Note: widening copies]); returns `dst`."""
    if dst.element_size() > src.element_size():
        torch._foreach_copy_([dst], [src])
        return dst
    return dst.copy_(src)
