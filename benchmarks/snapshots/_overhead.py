"""The step time with snapshots in host memory against torch DCP's async save, one rank.

One process trains the GPT (zeroshard, `stage`, bf16 on CUDA, fp32 on the CPU; AdamW
fused on CUDA) on random tokens and times blocks of `steps` steps in turn: nothing saved
(`none`), `Snapshots.take` every N-th step (`snapshot`), and torch DCP's `async_save`
every N-th step of the same tensors (the masters and optimizer state `save_checkpoint`
holds) into a folder in shared memory (`--shm`), each save first waiting for the one
before (`dcp-async`, as torchtitan does), and `take` every step of a second `Snapshots`
with a gradient journal (`journal`: every=1, full_every=K; a block's first take is a
full snapshot, then one every K steps, entries between: with blocks of a multiple of K
steps its mean step is the amortized one at K). Two DCP saves run untimed first; the
snapshots' first takes do not: each row's first block (the process's first takes: their
slots mapped and pinned) is reported apart, its figure is the median of the later blocks.
A block's time runs from its first step to its last step's end on the training stream: a
step's wait for an earlier save (a slot, a copy, DCP's save before) is in it, the last
save's copy on its side stream and background work are not (in a run they overlap the
next steps, as the earlier saves' did). That drain is then waited for and timed apart,
and the mean step with it is reported too. `take` (or `async_save`) alone is timed, and
`_profile` splits each snapshot's time (host, device, background).
Rounds alternate the order of the modes. Before each block the process collects its
garbage, waits for the device and, on a GPU, idles `SETTLE_S`: the block before's
leftovers (DCP's staging memory freed, its writer's threads ending) are not timed in the
next mode's block (a journal block right after DCP's ran 100 ms a step slower, with
nothing in its own profile to show for it).
"""

from __future__ import annotations

import gc
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import async_save

import zeroshard.engine as zs
from benchmarks._common import adamw, bench_model, sync
from benchmarks.snapshots._profile import Profile, crc_rate, profile_line
from zeroshard.engine import engine_state
from zeroshard.engine.state._checkpoint_layout import checkpoint_contents

# Seconds the GPU run idles before each block (the module docstring says why).
SETTLE_S = 2.0


@dataclass(frozen=True)
class Settings:
    """What one overhead run measures."""

    preset: str
    smoke: bool
    stage: int
    micro_batch: int
    steps: int
    warmup: int
    rounds: int
    every: tuple[int, ...]
    modes: tuple[str, ...]
    full_every: int
    on_gpu: bool
    shm: str
    out: str


@dataclass(frozen=True)
class Row:
    """One mode's result: mean step (median of its blocks after the first) and its save
    call's mean (over those blocks)."""

    mode: str
    every: int
    steps: int  # a block's
    step_ms: float
    blocks_ms: tuple[float, ...]
    # The wait for the block's last save after its last step (ms; the blocks in order).
    drains_ms: tuple[float, ...]
    call_ms: float
    snapshot_bytes: int
    # journal: the mean take at a full snapshot, at the entry after one and at the other
    # entries; the entry's bytes.
    journal_ms: tuple[float, float, float] | None = None
    entry_bytes: int = 0
    # Snapshots' rows: `_profile`'s summary of each block (the first one first).
    profile: tuple[dict[str, Any], ...] = ()


def run(rank: int, world: int, s: Settings) -> None:
    """Measure on this (only) rank; write the rows as JSON to `s.out`."""
    bench = bench_model(
        "gpt", s.preset, smoke=s.smoke, seq_len=None, activation_checkpointing=False
    )
    device = torch.device("cuda", 0) if s.on_gpu else torch.device("cpu")
    torch.manual_seed(0)
    with torch.device(device):
        model = bench.build()
    dtype = "bf16" if device.type == "cuda" else "fp32"
    model, opt = zs.initialize(
        model, adamw(model.parameters(), device), {"stage": s.stage, "compute_dtype": dtype}
    )
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randint(0, bench.vocab_size, (s.micro_batch, bench.seq_len), generator=g).to(device)
    y = torch.randint(0, bench.vocab_size, (s.micro_batch, bench.seq_len), generator=g).to(device)

    def step() -> None:
        model(x, y).backward()
        opt.step()
        opt.zero_grad()

    shm = Path(tempfile.mkdtemp(prefix="zeroshard-bench-", dir=s.shm))
    # One Snapshots for every N (its two slots reused): the modes call it every N-th step.
    snaps = zs.Snapshots(model, opt, every=1, root=shm / "snap") if "snapshot" in s.modes else None
    journal = None
    if "journal" in s.modes:
        journal = zs.Snapshots(model, opt, every=1, full_every=s.full_every, root=shm / "jrnl")
    # Wrapped before any take: the profile sees every one (journal_take calls the wrapper).
    profiles = {name: Profile(x) for name, x in (("snapshot", snaps), ("journal", journal)) if x}
    state = engine_state(model)
    entry = sum(g.master.nbytes for g in state.groups if g.trainable)
    calls: dict[str, list[float]] = {}
    pending: list[Any] = []
    # DCP's async save needs a CPU process group (training's may be NCCL alone).
    cpu_group = dist.new_group(backend="gloo")

    def dcp_save(n: int) -> None:
        if pending:
            pending.pop().result()
        _, tensors = checkpoint_contents(model, state)
        writer = FileSystemWriter(shm / "dcp", overwrite=True)
        pending.append(async_save(tensors, storage_writer=writer, process_group=cpu_group))

    def dcp_wait() -> None:
        if pending:
            pending.pop().result()

    def every(e: int, save: Callable[[int], object]) -> Callable[[int], object]:
        return lambda n: save(n) if n % e == 0 else None

    # The journal's takes by place: a full snapshot, the entry after it, the others.
    places: dict[str, list[float]] = {"full": [], "after": [], "entry": []}

    def journal_take(n: int) -> None:
        assert journal is not None
        full, start = journal._full, time.perf_counter()
        journal.take(n)
        took = time.perf_counter() - start
        place = "full" if journal._full == n else "after" if full == n - 1 else "entry"
        places[place].append(took)

    Mode = tuple[str, int, Callable[[int], object], Callable[[], None]]
    modes: list[Mode] = [("none", 1, lambda n: None, lambda: None)] if "none" in s.modes else []
    for e in s.every:
        if snaps is not None:
            modes.append(("snapshot", e, every(e, snaps.take), snaps.wait))
        if "dcp-async" in s.modes:
            modes.append(("dcp-async", e, every(e, dcp_save), dcp_wait))
    if journal is not None:
        modes.append(("journal", s.full_every, journal_take, journal.wait))
    blocks: dict[tuple[str, int], list[float]] = {}
    drains: dict[tuple[str, int], list[float]] = {}
    profiled: dict[tuple[str, int], list[dict[str, Any]]] = {}
    n = 0
    try:
        for _ in range(s.warmup):
            step()
        # After a step: before it the optimizer holds no state (AdamW's moments come at
        # the first step), and the snapshot would count the masters alone.
        _, tensors = checkpoint_contents(model, state)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
        # Untimed: DCP's first saves (its own set-up is not what this run compares). The
        # snapshots' first takes are in their rows' first blocks, reported apart.
        for n in (1, 2):
            if "dcp-async" in s.modes:
                dcp_save(n)
        dcp_wait()
        crc, rate = crc_rate()
        print(
            f"[snapshots] set up; a snapshot is {size / 2**30:.1f} GiB, a journal entry "
            f"{entry / 2**30:.1f} GiB; {crc} {rate:.1f} GB/s on one host thread",
            flush=True,
        )
        for r in range(s.rounds):
            for mode, e, save, finish in modes if r % 2 == 0 else modes[::-1]:
                prof = profiles.get(mode)
                if prof is not None:
                    prof.begin()
                if mode == "journal" and r == 1:  # `places` counts warm takes only
                    places.update(full=[], after=[], entry=[])
                gc.collect()
                sync(device)
                if s.on_gpu:
                    time.sleep(SETTLE_S)
                start = time.perf_counter()
                for _ in range(s.steps):
                    step()
                    n += 1
                    t = time.perf_counter()
                    save(n)
                    if r > 0 or s.rounds == 1:
                        calls.setdefault(f"{mode}-{e}", []).append(time.perf_counter() - t)
                steps_done(device)
                blocks.setdefault((mode, e), []).append((time.perf_counter() - start) / s.steps)
                drained = time.perf_counter()
                finish()
                sync(device)
                drains.setdefault((mode, e), []).append(time.perf_counter() - drained)
                if prof is not None:
                    profiled.setdefault((mode, e), []).append(prof.end(s.steps))
                # Each block as it ends: a run cut short by a time limit keeps these.
                print(
                    f"[snapshots] round {r + 1}, {mode} every {e}: "
                    f"{blocks[(mode, e)][-1] * 1e3:.1f} ms a step, then a drain of "
                    f"{drains[(mode, e)][-1] * 1e3:.1f} ms"
                    + ("" if prof is None else f"; {profile_line(profiled[(mode, e)][-1])}"),
                    flush=True,
                )
    finally:
        for done in (snaps, journal):
            if done is not None:
                done.close()
        shutil.rmtree(shm, ignore_errors=True)
    rows = [
        Row(
            mode,
            e,
            s.steps,
            statistics.median(b[1:] or b) * 1e3,
            tuple(x * 1e3 for x in b),
            tuple(x * 1e3 for x in drains[(mode, e)]),
            statistics.mean(calls[f"{mode}-{e}"]) * 1e3,
            size,
            None if mode != "journal" else _places_ms(places),
            entry,
            tuple(profiled.get((mode, e), ())),
        )
        for (mode, e), b in blocks.items()
    ]
    Path(s.out).write_text(json.dumps([asdict(r) for r in rows]))


def steps_done(device: torch.device) -> None:
    """Wait for the steps queued on the training stream, not for a snapshot's copy on its
    side stream: in a run that copy overlaps the next step, as the block's earlier ones did."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _places_ms(places: dict[str, list[float]]) -> tuple[float, float, float]:
    """The journal's mean take (ms) at a full snapshot, after one, at the other entries
    (nan: none, K = 2)."""
    mean = [statistics.mean(places[k]) * 1e3 if places[k] else float("nan") for k in places]
    return mean[0], mean[1], mean[2]
