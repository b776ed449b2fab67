"""crc32 of large buffers on several threads: the checksum checkpoints use, the same
value `zlib.crc32` gives, computed in pieces and combined.

zlib releases the GIL on large inputs, so pieces run in parallel; their crc32s are
joined with zlib's `crc32_combine` arithmetic (multiplying by the matrix that appends
n zero bytes, over GF(2)), whose matrix for the pieces' common length is built once.
"""

from __future__ import annotations

import functools
import os
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

_PIECE = 32 * 1024 * 1024
_POLY = 0xEDB88320
Matrix = tuple[int, ...]  # 32 columns of a 32x32 matrix over GF(2)


def _times(mat: Matrix, vec: int) -> int:
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _square(mat: Matrix) -> Matrix:
    return tuple(_times(mat, mat[n]) for n in range(32))


def _product(a: Matrix, b: Matrix) -> Matrix:
    """The matrix applying `b`, then `a`."""
    return tuple(_times(a, b[n]) for n in range(32))


@functools.cache
def _zeros(n: int) -> Matrix:
    """The matrix that takes a crc32 to the crc32 of its data followed by `n` zero bytes."""
    one_bit: Matrix = (_POLY, *(1 << k for k in range(31)))  # one zero bit appended
    power = _square(_square(_square(one_bit)))  # one zero byte
    out: Matrix = tuple(1 << k for k in range(32))  # identity
    while n:
        if n & 1:
            out = _product(power, out)
        power = _square(power)
        n >>= 1
    return out


def combine(crc1: int, crc2: int, len2: int) -> int:
    """The crc32 of A + B from crc32(A), crc32(B) and len(B)."""
    return _times(_zeros(len2), crc1) ^ crc2


_pool = ThreadPoolExecutor(max(1, min(8, (os.cpu_count() or 2) // 2)), "zeroshard-crc")


def crc32(data: memoryview, ready: Callable[[int], None] | None = None) -> int:
    """`zlib.crc32(data)`, its pieces on several threads; each piece once `ready(end)`
    returned, `end` its end's offset (bytes still arriving: [Note: the copy and the next
    step] in _host_copy.py)."""
    pieces = [data[i : i + _PIECE] for i in range(0, len(data), _PIECE)]

    def one(k: int) -> int:
        if ready is not None:
            ready(k * _PIECE + len(pieces[k]))
        return zlib.crc32(pieces[k])

    crc = 0
    for piece, part in zip(pieces, _pool.map(one, range(len(pieces))), strict=True):
        crc = combine(crc, part, len(piece))
    return crc
