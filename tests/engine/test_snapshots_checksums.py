"""The snapshots' checksum ([Note: the snapshot file] in zeroshard/engine/recovery/_file.py):
crc32c computed in pieces on threads and joined over GF(2) equals the `crc32c` package's
on the whole buffer; a file written before crc32c (zlib's crc32, the trailer's last 4
bytes zero) still verifies and restores; a flipped byte fails under either checksum; a
trailer naming a checksum this version does not know is refused by name."""

from __future__ import annotations

import struct
import warnings
import zlib
from pathlib import Path

import crc32c
import pytest
import torch

from tests._dist import run_ranks
from tests.engine.test_snapshots import _build, _state, _step
from zeroshard.ckpt import ChecksumError
from zeroshard.engine.recovery import Snapshots, _crc, _file
from zeroshard.engine.recovery._store import OWN

OLD_TRAILER = struct.Struct("<8sQI4x")  # before crc32c: zlib's crc32, 4 bytes of padding
TRAILER = OLD_TRAILER.size  # 24 bytes, then as now
PIECE = _crc._PIECE
# Odd lengths, and lengths at and around the threads' piece boundary (one piece, one
# byte into the second, several pieces with an odd tail).
LENGTHS = [0, 1, 3, 4095, 12_345, PIECE - 1, PIECE, PIECE + 1, 2 * PIECE + 7]
KINDS = {"crc32c": (_crc.CRC32C, crc32c.crc32c), "crc32": (_crc.CRC32, zlib.crc32)}


@pytest.fixture(scope="module")
def data() -> memoryview:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return torch.randint(0, 256, (max(LENGTHS),), dtype=torch.uint8).numpy().data


@pytest.mark.parametrize("name", KINDS)
def test_pieces_combine_to_the_whole_buffers_checksum(data: memoryview, name: str) -> None:
    """`checksum` (pieces on the pool's threads, joined by `combine`) and `combine` of
    two parts split at odd places equal the reference's value on the whole buffer."""
    kind, whole = KINDS[name]
    for n in LENGTHS:
        want = whole(data[:n])
        assert _crc.checksum(data[:n], kind) == want, n
        for cut in sorted({0, n // 3, n - 1, n} - {-1}):
            a, b = whole(data[:cut]), whole(data[cut:n])
            assert _crc.combine(a, b, n - cut, kind) == want, (n, cut)
    # The polynomial is what tells them apart (the same bytes, another value).
    other = _crc.CRC32 if kind is _crc.CRC32C else _crc.CRC32C
    assert _crc.checksum(data[:12_345], other) != whole(data[:12_345])


def _sealed() -> torch.Tensor:
    """A snapshot of a few tensors, sealed as `Snapshots` seals it."""
    items = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, 5).bfloat16()}
    planned = _file.plan(3, 0, 1, None, items, "{}")
    buf = torch.zeros(planned.size, dtype=torch.uint8)
    _file.fill_header(buf, planned)
    for key, place in _file.slots(buf, planned).items():
        place.copy_(items[key])
    _file.seal(buf)
    return buf


def _retrail(buf: torch.Tensor, tail: bytes) -> torch.Tensor:
    out = buf.clone()
    out[-len(tail) :] = torch.frombuffer(bytearray(tail), dtype=torch.uint8)
    return out


def _old_format(buf: torch.Tensor) -> torch.Tensor:
    """`buf` as the snapshots before crc32c wrote it."""
    end = buf.numel() - OLD_TRAILER.size
    crc = zlib.crc32(buf.numpy().data[:end])
    return _retrail(buf, OLD_TRAILER.pack(b"zsnap001", end, crc))


def _flipped(buf: torch.Tensor, at: int) -> torch.Tensor:
    out = buf.clone()
    out[at] ^= 0x10
    return out


def test_a_file_holds_crc32c_and_the_old_format_still_verifies() -> None:
    buf = _sealed()
    end = buf.numel() - TRAILER
    tail = bytes(buf[end:].numpy())
    assert (
        len(tail) == TRAILER
        and tail[:8] == b"zsnap001"
        and struct.unpack("<QII", tail[8:])
        == (
            end,
            crc32c.crc32c(buf.numpy().data[:end]),
            1,
        )
    )
    old = _old_format(buf)
    assert bytes(old[-4:].numpy()) == bytes(4) and not torch.equal(old, buf)
    for b in (buf, old):
        _file.check(b, "the file")
        snap = _file.parse(b, "the file")
        assert torch.equal(snap.tensors["a"], torch.arange(1000, dtype=torch.float32))
        assert torch.equal(snap.tensors["b"], torch.ones(3, 5).bfloat16())
    # A flipped byte in the header, the tensors or the recorded checksum fails under the
    # checksum the trailer names.
    for b, name in ((buf, "crc32c"), (old, "crc32")):
        for at in (20, end - 100, end + 16):
            with pytest.raises(ChecksumError, match=rf"the file: {name} is [0-9a-f]{{8}}, the"):
                _file.check(_flipped(b, at), "the file")


def test_a_trailer_naming_an_unknown_checksum_is_refused() -> None:
    buf = _sealed()
    end = buf.numel() - TRAILER
    crc = crc32c.crc32c(buf.numpy().data[:end])
    newer = _retrail(buf, struct.pack("<8sQII", b"zsnap001", end, crc, 7))
    with pytest.raises(ChecksumError, match=r"records checksum 7, unknown to this version"):
        _file.check(newer, "the file")
    with pytest.raises(ChecksumError, match=r"checksum 7, unknown"):
        _file.trailer_crc(newer, "the replica")  # the replica's receiver refuses it too


def _rewrite(path: Path, how: str) -> None:
    """Rewrite a snapshot file's trailer in place: in the old format, or naming code 7."""
    buf = _file.mapped(path)
    end = buf.numel() - TRAILER
    if how == "old":
        tail = OLD_TRAILER.pack(b"zsnap001", end, zlib.crc32(buf.numpy().data[:end]))
    else:
        tail = struct.pack("<8sQII", b"zsnap001", end, crc32c.crc32c(buf.numpy().data[:end]), 7)
    with open(path, "r+b") as f:
        f.seek(end)
        f.write(tail)


def _restores(folder: str, how: str) -> None:
    model, opt, sched = _build(2, "cpu")
    data = {"next_step": 0}
    client = {"sched": sched, "data": data}
    snaps = Snapshots(model, opt, every=2, client_state=client, root=f"{folder}/shm")
    try:
        for s in range(2):
            _step(model, opt, sched, s)
            data["next_step"] = s + 1
            snaps.take(s + 1)
        snaps.wait()
        want = _state(model, opt)
        _rewrite(snaps.store.path(2, 0, 1, OWN), how)
        _step(model, opt, sched, 2)  # moved on past the snapshot
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = snaps.resume(f"{folder}/ckpt")
        texts = [str(w.message) for w in caught if "resume" in str(w.message)]
        if how == "unknown":  # refused, by name; no disk checkpoint: a fresh start
            assert step is None and len(texts) == 1, texts
            assert "records checksum 7, unknown to this version" in texts[0], texts
            return
        assert step == 2 and snaps.last_resume.source == "memory" and not texts, texts
        assert client["data"] == {"next_step": 2}
        got = _state(model, opt)
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert torch.equal(got[k], v), k
    finally:
        snaps.close()


@pytest.mark.parametrize("how", ["old", "unknown"])
def test_resume_reads_the_old_format_and_refuses_an_unknown_checksum(
    tmp_path: Path, how: str
) -> None:
    """A snapshot whose trailer holds zlib's crc32 (written before crc32c) restores bit
    for bit; one naming a checksum this version does not know is refused, one warning
    naming it."""
    run_ranks(_restores, 1, str(tmp_path), how)
