"""Checksums of large buffers on several threads, computed in pieces and combined:
crc32c (Castagnoli's polynomial, in hardware: SSE4.2, ARMv8's CRC32), the snapshots',
and zlib's crc32, the checkpoints', which snapshots written before crc32c hold.

Both release the GIL on large inputs, so pieces run in parallel; their checksums are
joined with zlib's `crc32_combine` arithmetic (multiplying by the matrix that appends
n zero bytes, over GF(2), for the checksum's polynomial), whose matrix for the pieces'
common length is built once.
"""

from __future__ import annotations

import functools
import os
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import crc32c as _crc32c

_PIECE = 32 * 1024 * 1024
Matrix = tuple[int, ...]  # 32 columns of a 32x32 matrix over GF(2)


class Checksum(NamedTuple):
    """A reflected 32-bit CRC (initial and final value all ones): its name, its
    polynomial (bit-reversed) and a function computing it on a whole buffer."""

    name: str
    poly: int
    of: Callable[[memoryview], int]


CRC32 = Checksum("crc32", 0xEDB88320, zlib.crc32)
CRC32C = Checksum("crc32c", 0x82F63B78, _crc32c.crc32c)


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
def _zeros(n: int, poly: int) -> Matrix:
    """The matrix that takes a CRC of polynomial `poly` to the CRC of its data followed
    by `n` zero bytes."""
    one_bit: Matrix = (poly, *(1 << k for k in range(31)))  # one zero bit appended
    power = _square(_square(_square(one_bit)))  # one zero byte
    out: Matrix = tuple(1 << k for k in range(32))  # identity
    while n:
        if n & 1:
            out = _product(power, out)
        power = _square(power)
        n >>= 1
    return out


def combine(crc1: int, crc2: int, len2: int, kind: Checksum) -> int:
    """The checksum `kind` of A + B from its values on A and on B and len(B)."""
    return _times(_zeros(len2, kind.poly), crc1) ^ crc2


_pool = ThreadPoolExecutor(max(1, min(8, (os.cpu_count() or 2) // 2)), "zeroshard-crc")


def checksum(data: memoryview, kind: Checksum, ready: Callable[[int], None] | None = None) -> int:
    """`kind.of(data)`, its pieces on several threads; each piece once `ready(end)`
    returned, `end` its end's offset (bytes still arriving: [Note: the copy and the next
    step] in _host_copy.py)."""
    pieces = [data[i : i + _PIECE] for i in range(0, len(data), _PIECE)]

    def one(k: int) -> int:
        if ready is not None:
            ready(k * _PIECE + len(pieces[k]))
        return kind.of(pieces[k])

    crc = 0
    for piece, part in zip(pieces, _pool.map(one, range(len(pieces))), strict=True):
        crc = combine(crc, part, len(piece), kind)
    return crc
