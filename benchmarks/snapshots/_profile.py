"""Where a snapshotting step's time goes: each `take` of one `Snapshots`, timed by
wrapping that object's own methods (nothing else in the run changes).

Per take, on the host: seconds inside `take`, of them waiting for a free slot (the
snapshot that frees it: `Background.wait_complete`) and for the entry before's device
copy (its gradients' memory is held until then); the bytes copied (those on the device).
On the device: how long the copy took from the end of the step it snapshots (CUDA
events; a host tensor is copied inside `take`). In the background, from the take's
start: when the checksum was done (the bytes seal as they land, so this is also when the
last of them had landed or later), the file was linked, and replicated and agreed
complete. Per step, on the device: how long the optimizer step's stream sat
waiting for the copy (`wait_before_step`; CUDA events around it, none on the CPU).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zeroshard.engine import Snapshots
from zeroshard.engine.recovery import _file


@dataclass
class Take:
    """One `take`: host seconds, bytes, and the background's times from its start."""

    kind: str  # "full" or "entry"
    host_s: float = 0.0
    slot_wait_s: float = 0.0
    copy_wait_s: float = 0.0
    bytes: int = 0
    device_bytes: int = 0
    start: float = 0.0
    # The device's events: the step's end on the training stream, the copy's on its own.
    copy_events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    copy_s: float = float("nan")
    sealed_s: float = float("nan")
    linked_s: float = float("nan")
    done_s: float = float("nan")


@dataclass
class Block:
    """The takes and device stalls of one timed block."""

    takes: dict[int, Take] = field(default_factory=dict)
    stalls: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)


def _step_of(final: Path) -> int:
    return int(final.parent.name.split("-")[1])  # `step-{S}/...` ([Note: a node's snapshots])


class Profile:
    """Wraps `snaps`' take, slot waits, copy, link, replication and pre-step wait; the
    records go to the block begun last."""

    def __init__(self, snaps: Snapshots) -> None:
        self.block = Block()
        self._now: Take | None = None  # the take running on the main thread
        work, copy, store = snaps._work, snaps._copy, snaps.store
        take, wait_complete, start = snaps.take, work.wait_complete, copy.start
        link, replicate, before = store.link, snaps._replicate, copy.wait_before_step

        def timed_take(step: int) -> bool:
            record = Take("entry", start=time.perf_counter())
            if torch.cuda.is_available():
                record.copy_events = (_event(), _event())
                record.copy_events[0].record()
            self._now = record
            try:
                took = take(step)
            finally:
                self._now = None
            record.host_s = time.perf_counter() - record.start
            if took:
                record.kind = "full" if snaps._full == step else "entry"
                self.block.takes[step] = record
            return took

        def timed_wait_complete(step: int) -> None:
            t = time.perf_counter()
            wait_complete(step)
            if self._now is not None:
                self._now.slot_wait_s += time.perf_counter() - t

        def timed_start(sources: Mapping[str, torch.Tensor], places: Any, **how: bool) -> Any:
            record = self._now
            ready = start(sources, places, **how)
            if record is None:  # a resume's republish: not a take
                return ready
            record.bytes += sum(p.nbytes for p in places.values())
            on_device = sum(t.nbytes for t in sources.values() if t.device.type != "cpu")
            record.device_bytes += on_device
            if on_device and record.copy_events is not None:
                record.copy_events[1].record(copy._stream)

            def timed_ready(upto: int | None = None) -> None:
                t = time.perf_counter()
                ready(upto)
                main = threading.current_thread() is threading.main_thread()
                if upto is None and main and self._now is not None:
                    self._now.copy_wait_s += time.perf_counter() - t  # the next take's wait

            return timed_ready

        def timed_link(slot: Path, final: Path) -> None:
            record = self.block.takes.get(_step_of(final))
            t = time.perf_counter()
            link(slot, final)
            if record is not None:
                record.sealed_s = t - record.start
                record.linked_s = time.perf_counter() - record.start

        def timed_replicate(step: int, buf: torch.Tensor, entry: bool, ring: int | None) -> None:
            replicate(step, buf, entry, ring)
            record = self.block.takes.get(step)
            if record is not None:
                record.done_s = time.perf_counter() - record.start

        def timed_before() -> None:
            if not torch.cuda.is_available() or copy._copied is None:
                before()
                return
            pair = (_event(), _event())
            pair[0].record()
            before()
            pair[1].record()
            self.block.stalls.append(pair)

        snaps.take = timed_take  # type: ignore[method-assign]
        work.wait_complete = timed_wait_complete  # type: ignore[method-assign]
        copy.start = timed_start  # type: ignore[method-assign]
        store.link = timed_link  # type: ignore[method-assign]
        snaps._replicate = timed_replicate  # type: ignore[method-assign]
        copy.wait_before_step = timed_before  # type: ignore[method-assign]

    def begin(self) -> None:
        """Start a new block."""
        self.block = Block()

    def end(self, steps: int) -> dict[str, Any]:
        """The block's summary (after its background work was waited for and the device
        synchronized): per kind of take the medians, per step the means."""
        b = self.block
        stall = sum(a.elapsed_time(z) for a, z in b.stalls) / 1e3
        for t in b.takes.values():
            if t.copy_events is not None and t.device_bytes:
                t.copy_s = t.copy_events[0].elapsed_time(t.copy_events[1]) / 1e3
        out: dict[str, Any] = {
            "stall_ms_per_step": stall / steps * 1e3,
            "gib_per_step": sum(t.bytes for t in b.takes.values()) / steps / 2**30,
            # Each take in step order: medians hide the slow ones (a ring place's first
            # use, a slot waiting for the snapshot before).
            "each": [
                (step, t.kind, t.host_s * 1e3, t.slot_wait_s * 1e3, t.sealed_s * 1e3)
                for step, t in sorted(b.takes.items())
            ],
        }
        for kind in ("full", "entry"):
            takes = [t for t in b.takes.values() if t.kind == kind]
            if takes:
                out[kind] = {"n": len(takes), "mib": takes[0].bytes / 2**20} | {
                    name: _median_ms([getattr(t, name) for t in takes])
                    for name in (
                        "host_s",
                        "slot_wait_s",
                        "copy_wait_s",
                        "copy_s",
                        "sealed_s",
                        "linked_s",
                        "done_s",
                    )
                }
        return out


def _event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def _median_ms(values: Sequence[float]) -> float:
    known = [v for v in values if v == v]
    return statistics.median(known) * 1e3 if known else float("nan")


def crc_rate(mib: int = 256) -> tuple[str, float]:
    """The checksum snapshots are sealed with, on one thread of this host: its name, GB/s."""
    kind = _file.CHECKSUM
    data = torch.randint(0, 256, (mib << 20,), dtype=torch.uint8).numpy().data
    kind.of(data[: 1 << 20])
    t = time.perf_counter()
    kind.of(data)
    return kind.name, len(data) / (time.perf_counter() - t) / 1e9


# `Profile.end`'s figures by kind of take, in the order the report shows them.
COLUMNS = (
    ("host_s", "take"),
    ("slot_wait_s", "slot wait"),
    ("copy_wait_s", "copy wait"),
    ("copy_s", "copy (device)"),
    ("sealed_s", "sealed"),
    ("linked_s", "linked"),
    ("done_s", "complete"),
)


def ms(value: float) -> str:
    """A figure of milliseconds as the report prints it ('-': none measured)."""
    return f"{value:.1f}" if value == value else "-"


def profile_line(block: Mapping[str, Any]) -> str:
    """One block's profile in a line (printed as the block ends)."""
    parts = [
        f"stall {block['stall_ms_per_step']:.1f} ms/step, {block['gib_per_step']:.2f} GiB/step"
    ]
    for kind in ("full", "entry"):
        if kind in block:
            k = block[kind]
            times = ", ".join(f"{label} {ms(k[name])}" for name, label in COLUMNS)
            parts.append(f"{kind} x{k['n']} ({k['mib']:,.0f} MiB): {times} ms")
    each = " ".join(
        f"{step}{kind[0]}:{host:.0f}/{wait:.0f}/{ms(sealed)}"
        for step, kind, host, wait, sealed in block.get("each", ())
    )
    parts.append(f"each take (step, f/e: take/slot wait/sealed ms): {each}")
    return "; ".join(parts)
