"""Host (CPU) buffers, pinned when the platform allows it.

[Note: exact pinning]
torch's pinned allocator (`pin_memory=True`) rounds every allocation up to the next power
of two and page-locks all of it: a 10.1 GB buffer pins 16 GiB, a 17.2 GB one 32 GiB.
Offload's gradient buffer is one such tensor (2 bytes a parameter): at 5.05B parameters it
pinned 6.6 GiB more than it held, bytes no estimate counted, and past 8.59B it would pin
16 GiB more. So a buffer of at least `EXACT_PIN_BYTES` whose size is not a power of two is
allocated at its size (libc's `malloc`) and page-locked in place through the CUDA driver
(`cuMemHostRegister`), which CUDA then treats as any pinned memory (asynchronous copies,
`is_pinned()`). The driver is called, not the runtime: a refused registration then leaves
no error behind in the runtime for torch's next kernel launch to raise. The memory is
unlocked and freed when the last tensor viewing it is gone. Unlike torch's allocator,
which records an event for each asynchronous copy and frees a block only after them, that
free does not wait for copies still in flight: the owner keeps a buffer until its copies
completed (offload holds its buffers for the engine's life and drains its copies at the
end of every backward; the flatten tier's copies are synchronous). Smaller buffers keep
torch's allocator, which caches and reuses them.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

# Below this, or at a power of two, torch's pinned allocator wastes little or nothing.
EXACT_PIN_BYTES = 256 * 2**20
_ALIGN = 64  # bytes, as torch's CPU allocator aligns
_CU_MEMHOSTREGISTER_PORTABLE = 0x01  # pinned for every CUDA context, as torch's is


def empty_host(numel: int, dtype: torch.dtype, *, pin: bool) -> tuple[torch.Tensor, bool]:
    """An uninitialised 1-D host tensor and whether it is pinned.

    Pinned (page-locked) memory lets host<->device copies run asynchronously and at full
    bus speed; it needs CUDA, and a large pin can fail where pageable memory would not,
    so any failure falls back to pageable memory. The caller decides whether to warn.
    Large buffers are pinned at their own size ([Note: exact pinning]).
    """
    if pin and torch.cuda.is_available():
        nbytes = numel * dtype.itemsize
        if nbytes >= EXACT_PIN_BYTES and nbytes & (nbytes - 1):
            locked = _page_locked(numel, dtype)
            if locked is not None:
                return locked, True
        else:
            try:
                return torch.empty(numel, dtype=dtype, pin_memory=True), True
            except RuntimeError:
                pass
    return torch.empty(numel, dtype=dtype), False


@functools.cache
def _libraries() -> tuple[Any, Any] | None:
    """libc and the CUDA driver, with the functions used here typed; None without them."""
    try:
        libc, cuda = ctypes.CDLL(None), ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.restype, libc.free.argtypes = None, [ctypes.c_void_p]
    register = cuda.cuMemHostRegister_v2
    register.restype = ctypes.c_int
    register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    unregister = cuda.cuMemHostUnregister
    unregister.restype, unregister.argtypes = ctypes.c_int, [ctypes.c_void_p]
    return libc, cuda


def _page_locked(numel: int, dtype: torch.dtype) -> torch.Tensor | None:
    """`numel` elements of host memory, page-locked in place; None where that fails."""
    libs = _libraries()
    if libs is None:
        return None
    libc, cuda = libs
    nbytes = numel * dtype.itemsize
    base = libc.malloc(nbytes + _ALIGN)
    if not base:
        return None
    start = base + (-base) % _ALIGN
    # The driver registers in the context current on this thread: make torch's current
    # (the runtime does so on its first call needing one).
    torch.cuda.synchronize()
    if cuda.cuMemHostRegister_v2(start, nbytes, _CU_MEMHOSTREGISTER_PORTABLE) != 0:
        libc.free(base)
        return None

    class Locked(ctypes.c_ubyte * nbytes):  # type: ignore[misc]
        """The registered bytes, as a buffer torch can view; owns them."""

        def __del__(self) -> None:
            # torch releases the buffer with the last tensor viewing it: unlock, then free.
            cuda.cuMemHostUnregister(start)
            libc.free(base)

    memory = Locked.from_address(start)
    return torch.frombuffer(memory, dtype=dtype, count=numel)
