"""`cast_into` against `copy_`: the same bits for every pair of float dtypes the engine
casts between ([Note: widening copies]). It matters on CUDA, where the widening pairs
take `_foreach_copy_`'s kernel instead of `copy_`'s; the `gpu` session runs it there."""

from __future__ import annotations

import pytest
import torch

from zeroshard.engine.runtime._casts import cast_into

FLOATS = [torch.float32, torch.bfloat16, torch.float16]
BITS = {4: torch.int32, 2: torch.int16}


def _values(device: str) -> torch.Tensor:
    # Every magnitude fp32 holds (subnormals to overflow in fp16), signs, and the specials;
    # an odd length leaves a tail past any vector width.
    torch.manual_seed(0)
    n = 100_003
    scale = torch.logspace(-44, 38, n, dtype=torch.float64).clamp(max=3e38).float()
    x = torch.randn(n) * scale
    x[:7] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-45, 7e4])
    return x.to(device)


@pytest.mark.gpu
@pytest.mark.parametrize("src_dtype", FLOATS, ids=str)
@pytest.mark.parametrize("dst_dtype", FLOATS, ids=str)
def test_cast_into_writes_the_bits_copy_writes(
    src_dtype: torch.dtype, dst_dtype: torch.dtype, device: str
) -> None:
    src = _values(device).to(src_dtype)
    want = torch.empty_like(src, dtype=dst_dtype).copy_(src)
    dst = torch.full_like(want, 1.0)
    assert cast_into(dst, src) is dst
    bits = BITS[dst.element_size()]
    assert torch.equal(dst.view(bits), want.view(bits)), f"{src_dtype} -> {dst_dtype}"
