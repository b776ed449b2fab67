"""The streamed writer's memory bound: bytes in flight stay under `max_buffer_bytes`
whatever the number of workers, and the output stays exact.

Three views of "in flight": the pool's own count (`WriteResult.peak_buffer_bytes`),
the buffers the specs are handed while they read (tracked by the test, independent of
the pool), and the resident set of a process consolidating real files.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.ckpt._model import same_bits
from zeroshard.ckpt import CheckpointError
from zeroshard.ckpt._buffers import BufferPool
from zeroshard.ckpt._spec import TensorSpec
from zeroshard.ckpt._writer import RangeSpec, write_safetensors

MIB = 1024 * 1024


class _Tracker:
    """Counts, from inside the specs' reads, the bytes of distinct buffers being read at
    once (a source and its cast share one buffer, so the base's size is what counts)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active: dict[int, int] = {}  # buffer address -> bytes, during a read
        self.peak_bytes = 0
        self.peak_reads = 0
        self.overlapped: set[str] = set()  # names read while another read was going on

    def reading(self, name: str, out: torch.Tensor) -> _Reading:
        return _Reading(self, name, out)


class _Reading:
    def __init__(self, tracker: _Tracker, name: str, out: torch.Tensor) -> None:
        base = out._base if out._base is not None else out
        self.t, self.name = tracker, name
        self.key, self.nbytes = base.data_ptr(), base.untyped_storage().nbytes()

    def __enter__(self) -> None:
        t = self.t
        with t.lock:
            if t.active:
                t.overlapped.add(self.name)
            t.active[self.key] = self.nbytes
            t.peak_bytes = max(t.peak_bytes, sum(t.active.values()))
            t.peak_reads = max(t.peak_reads, len(t.active))

    def __exit__(self, *exc: object) -> None:
        with self.t.lock:
            if len(self.t.active) > 1:
                self.t.overlapped.add(self.name)
            del self.t.active[self.key]


def _specs(
    tracker: _Tracker, sources: dict[str, torch.Tensor], whole: set[str]
) -> list[TensorSpec]:
    specs: list[TensorSpec] = []
    for name, src in sources.items():

        def read_range(start: int, out: torch.Tensor, name: str = name) -> None:
            with tracker.reading(name, out):
                time.sleep(0.005)  # long enough for other workers to be mid-read too
                out.copy_(sources[name].view(-1)[start : start + out.numel()])

        def read(out: torch.Tensor, rr: Callable[[int, torch.Tensor], None] = read_range) -> None:
            rr(0, out)

        if name in whole:
            specs.append(TensorSpec(name, tuple(src.shape), src.dtype, read))
        else:
            specs.append(RangeSpec(name, tuple(src.shape), src.dtype, read, read_range))
    return specs


def _sources() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {f"w{i}": torch.randn(700_001 + 1000 * i, generator=g) for i in range(6)}
    out["h"] = torch.randn(1_500_000, generator=g).to(torch.bfloat16)
    out["i"] = torch.arange(50_000, dtype=torch.int64)
    out["b"] = torch.randn(33, generator=g)
    return out


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float32])
def test_bytes_in_flight_never_exceed_the_bound(tmp_path: Path, dtype: torch.dtype) -> None:
    sources = _sources()
    tracker = _Tracker()
    bound = 4 * MIB
    out = tmp_path / "m.safetensors"
    r = write_safetensors(
        _specs(tracker, sources, whole={"i", "b"}),
        out,
        dtype=dtype,
        workers=16,
        max_buffer_bytes=bound,
    )
    # 16 workers would hold ~40 MiB at once without the bound.
    assert 0 < r.peak_buffer_bytes <= bound
    assert 0 < tracker.peak_bytes <= bound
    assert tracker.peak_reads >= 2  # the bound still lets workers run side by side
    got = load_file(str(out))
    for name, src in sources.items():
        want = src.to(dtype) if dtype is not None and src.is_floating_point() else src
        assert same_bits(got[name], want), name


def test_a_whole_tensor_over_the_bound_is_read_alone(tmp_path: Path) -> None:
    sources = _sources()
    sources["big"] = torch.randn(1_000_000)  # 4 MB, not a RangeSpec: cannot be split
    tracker = _Tracker()
    r = write_safetensors(
        _specs(tracker, sources, whole={"big"}),
        tmp_path / "m.safetensors",
        workers=8,
        max_buffer_bytes=2 * MIB,
    )
    assert "big" not in tracker.overlapped  # no other read began or ended during it
    assert r.peak_buffer_bytes == sources["big"].numel() * 4  # it alone was over the bound
    assert len(tracker.overlapped) > 0  # the others did overlap
    got = load_file(str(tmp_path / "m.safetensors"))
    assert all(same_bits(got[k], v) for k, v in sources.items())


def test_pool_reuses_frees_and_refuses_a_bad_bound() -> None:
    pool = BufferPool(limit=8 * MIB, keep=4 * MIB)
    a = pool.take(3 * MIB)
    pool.give(a)
    b = pool.take(2 * MIB)  # reuses a: the smallest idle buffer that fits
    assert b.data_ptr() == a.data_ptr() and pool.held == 3 * MIB
    s = pool.take(1000)  # small: no idle buffer fits, a new one (freed when given back)
    assert pool.held == 3 * MIB + 1000
    pool.give(s)
    pool.give(b)
    c = pool.take(7 * MIB)  # frees the idle buffer to make room (storage gone at once)
    assert a.untyped_storage().nbytes() == 0 and pool.held == 7 * MIB
    pool.give(c)  # bigger than `keep`: freed, not kept
    assert c.untyped_storage().nbytes() == 0 and pool.held == 0 and pool.peak == 7 * MIB
    with pytest.raises(ValueError, match="must be >= 1 byte"):
        BufferPool(limit=0, keep=1)
    with pytest.raises(CheckpointError, match="max_buffer_bytes must be >= 1"):
        write_safetensors(
            [TensorSpec("t", (1,), torch.float32, lambda o: None)],
            Path("/nonexistent/x.safetensors"),
            max_buffer_bytes=0,
        )


_RSS_SCRIPT = """
import os, sys, torch
from zeroshard.ckpt._writer import RangeSpec, write_safetensors
from zeroshard.ckpt._stfile import pread_into

src, out, bound = sys.argv[1], sys.argv[2], int(sys.argv[3])
fd = os.open(src, os.O_RDONLY)
n = 4 * 1024 * 1024  # fp32 elements per tensor: 16 MiB
def spec(i):
    def read_range(start, t):
        pread_into(fd, t, (i * n + start) * 4, src)
    return RangeSpec(f"t{i}", (n,), torch.float32, lambda t: read_range(0, t), read_range)
specs = [spec(i) for i in range(12)]
def status(key):
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) * 1024 for x in f if x.startswith(key))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak resident set (VmHWM) to the current one
before = status("VmRSS:")
r = write_safetensors(specs, out, workers=16, max_buffer_bytes=bound)
print(status("VmHWM:") - before, r.peak_buffer_bytes)
"""


def test_resident_memory_of_a_real_consolidation(tmp_path: Path) -> None:
    """192 MiB from a real file with 16 workers: the process grows by about the bound,
    not by 16 tensors (the pre-bound writer grew by ~192 MiB here)."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak resident set")
    src = tmp_path / "src.bin"
    with open(src, "wb") as f:
        f.truncate(12 * 16 * MIB)  # sparse: reads are real syscalls but cost no disk
    bound = 32 * MIB
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(_RSS_SCRIPT),
            str(src),
            str(tmp_path / "o"),
            str(bound),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    if p.returncode != 0 and "clear_refs" in p.stderr:
        pytest.skip(f"cannot reset the peak resident set here: {p.stderr.strip()[-200:]}")
    assert p.returncode == 0, p.stderr
    grown, peak = map(int, p.stdout.split())
    assert 0 < peak <= bound
    # Slack for thread stacks, malloc arenas and the page tables of 16 threads.
    assert grown <= bound + 24 * MIB, f"grew by {grown / MIB:.1f} MiB"
    assert (tmp_path / "o" / "model.safetensors").stat().st_size > 12 * 16 * MIB
