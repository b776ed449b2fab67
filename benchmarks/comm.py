"""Bus bandwidth of zeroshard's coalesced all-gather / reduce-scatter against raw collectives.

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node=2 -m benchmarks.comm
    python -m benchmarks.comm --smoke      # relaunches itself on 2 CPU ranks (gloo)

For every size S (1 MiB .. 1 GiB, bf16) the payload is the parameters of 4 transformer
blocks (LayerNorms, QKV, projection, MLP up and down, their biases: 48 tensors of mixed
sizes, plus one remainder so the total is exactly S). Coalesced all-gather: each rank
holds a 1/world shard of every tensor and `all_gather_coalesced` packs, gathers and
unpacks (views) them; the peer is one raw `all_gather_into_tensor` of a preallocated
buffer of the same total size (S is the gathered bytes). Coalesced reduce-scatter: each
rank holds the full tensors (S bytes) and `reduce_scatter_coalesced` packs (zero-pads,
interleaves), reduce-scatters and unpacks them; the peer is one raw
`reduce_scatter_tensor` of an S-byte buffer. In the main table every coalesced call is
one bucket (one collective, like the peer); the sweep table splits it into smaller ones.

Two ways of calling, both timed on the device with CUDA events while the host queues
ahead: `single`, each call waited before the next is packed (nothing to overlap the pack
with); `streamed`, the next call issued before the previous one is waited, as a prefetch
or a bucketed backward does (the pack of call i+1 runs while collective i runs). Time is
the median period between successive calls in steady state, slowest rank. `streamed hp`
repeats `streamed` on a process group whose NCCL stream has high priority (`pg_options`
with `is_high_priority_stream`), so the packs do not delay the collectives; its ratio is
against the raw peer on that same group. `pack` is the packing kernel(s) alone. Bus
bandwidth is S / time * (n-1)/n. Full runs write the "comm" section of
docs/benchmarks.md; `--smoke` (CPU, gloo, small sizes) writes bench-out/comm.md only.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from benchmarks._report import init_ranks, markdown_table, publish
from zeroshard.comm import (
    Group,
    Handle,
    all_gather_coalesced,
    reduce_scatter_coalesced,
    wait_all,
)
from zeroshard.comm._coalesce import _buckets, _pack_gather_input, _pack_reduce_input

MIB = 1024**2
BLOCKS = 4
GOAL = 0.95
_all_gather_flat = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU/gloo, small sizes, bench-out only")
    p.add_argument("--min-mib", type=float, default=1.0, help="smallest size S in MiB")
    p.add_argument("--max-mib", type=float, default=1024.0, help="largest size S in MiB")
    p.add_argument("--iters", type=int, default=50, help="timed iterations per measurement")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations first")
    p.add_argument(
        "--sweep-mib",
        default="16,64,256",
        help="bucket sizes (MiB) for the sweep table, at sizes >= 64 MiB above the bucket",
    )
    p.add_argument("--nproc", type=int, default=2, help="ranks when not launched by torchrun")
    p.add_argument("--no-write", action="store_true", help="print the tables, write nothing")
    args = p.parse_args()
    if args.smoke:
        args.min_mib, args.max_mib, args.iters, args.warmup = 0.25, 4.0, 5, 1
        args.sweep_mib = "0.5,1"
    return args


def block_numels(total: int, multiple: int) -> list[int]:
    """Numels of BLOCKS transformer blocks of hidden size h, plus a remainder: sum == total.

    h is the largest multiple of `multiple` whose blocks fit; every numel is a multiple of
    `multiple` when `total` is.
    """
    per_block = total // BLOCKS
    h = int((-13 + math.sqrt(169 + 48 * per_block)) / 24) // multiple * multiple
    h = max(h, multiple)
    block = [h, h, 3 * h * h, 3 * h, h * h, h, h, h, 4 * h * h, 4 * h, 4 * h * h, h]
    numels = block * BLOCKS
    rest = total - sum(numels)
    while rest < 0:  # tiny sizes: drop tensors until the blocks fit
        rest += numels.pop()
    return [*numels, rest] if rest else numels


@dataclass(frozen=True)
class Timing:
    """Slowest rank's median device milliseconds per call, and host microseconds per call."""

    ms: float
    host_us: float

    def busbw(self, nbytes: int, world: int) -> float:
        """Bus bandwidth in GB/s for `nbytes` moved in this time."""
        return nbytes / (self.ms / 1e3) * (world - 1) / world / 1e9 if world > 1 else 0.0


class _Waitable(Protocol):
    def wait(self) -> object: ...


Issue = Callable[[], Sequence[_Waitable]]

_CYCLES_PER_MS = 0.0


def _cycles_per_ms() -> float:
    """Clock rate of torch.cuda._sleep, measured once."""
    global _CYCLES_PER_MS
    if not _CYCLES_PER_MS:
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        torch.cuda._sleep(10_000_000)  # type: ignore[no-untyped-call]
        end.record()
        torch.cuda.synchronize()
        _CYCLES_PER_MS = 10_000_000 / start.elapsed_time(end)
    return _CYCLES_PER_MS


def _slowest(values: list[float], cuda: bool) -> list[float]:
    """Element-wise maximum over ranks."""
    t = torch.tensor(values, dtype=torch.float64, device="cuda" if cuda else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t]


def measure(issue: Issue, depth: int, iters: int, warmup: int, cuda: bool) -> Timing:
    """Median period between successive calls of `issue` and its host cost, slowest rank.

    `depth` is how many calls stay in flight: 0 waits each call's handles before the next
    call, 1 issues call i+1 before waiting call i. On CUDA a sleep kernel (as long on
    every rank) first holds the stream while the host queues every call, so the events
    time the device's work back to back, not the gaps in which it waits for the host.
    """
    for _ in range(warmup):
        for h in issue():
            h.wait()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(3):
        for h in issue():
            h.wait()
    host_us = (time.perf_counter() - t0) / 3 * 1e6
    if cuda:
        torch.cuda.synchronize()
    # Enough sleep to cover queueing all calls, with a 2x margin, plus 1 ms; the same
    # length on every rank so no rank's first collective waits for a later peer.
    sleep_ms = 2 * iters * host_us / 1e3 + 1
    (cycles,) = _slowest([_cycles_per_ms() * sleep_ms if cuda else 0.0], cuda)
    dist.barrier()
    pending: list[Sequence[_Waitable]] = []
    new_event = torch.cuda.Event
    events = [new_event(enable_timing=True) for _ in range(iters + 1)] if cuda else []  # type: ignore[no-untyped-call]
    stamps: list[float] = []  # host milliseconds, on the CPU
    if cuda:
        torch.cuda._sleep(int(cycles))  # type: ignore[no-untyped-call]
    for i in range(iters + 1):
        if cuda:
            events[i].record()
        else:
            stamps.append(time.perf_counter() * 1e3)
        if i == iters:
            break
        pending.append(issue())
        if len(pending) > depth:
            for h in pending.pop(0):
                h.wait()
    for handles in pending:
        for h in handles:
            h.wait()
    if cuda:
        torch.cuda.synchronize()
        periods = [events[i].elapsed_time(events[i + 1]) for i in range(iters)]
    else:
        periods = [stamps[i + 1] - stamps[i] for i in range(iters)]
    # The first `depth` periods only fill the pipeline.
    ms, host = _slowest([statistics.median(periods[depth:]), host_us], cuda)
    return Timing(ms, host)


@dataclass(frozen=True)
class Row:
    """One (size, op, bucket size) result: raw and coalesced, single and streamed."""

    size: int
    op: str
    tensors: int
    buckets: int
    bucket_bytes: int
    raw: Timing
    streamed: Timing
    pack: Timing
    single: Timing | None = None
    raw_hp: Timing | None = None
    streamed_hp: Timing | None = None


class _Work:
    """A torch Work seen through the `wait()` the timing loop calls."""

    def __init__(self, work: dist.Work | None) -> None:
        self.work = work

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()


class Bench:
    """Tensors and closures for one size S on this rank."""

    def __init__(
        self,
        size: int,
        device: torch.device,
        cuda: bool,
        args: argparse.Namespace,
        high_priority: Group | None,
    ):
        self.size, self.cuda, self.args = size, cuda, args
        self.group = Group()
        self.high_priority = high_priority
        world = self.world = self.group.size
        dtype = torch.bfloat16
        total = size // dtype.itemsize
        numels = block_numels(total, 8)
        # The same data on every rank (same seed), so a reduced sum is world x own.
        torch.manual_seed(size)
        # All-gather: every rank holds a shard of each tensor (uneven sizes round up).
        self.shards = [torch.randn(-(-n // world), device=device).to(dtype) for n in numels]
        self.full = [torch.randn(n, device=device).to(dtype) for n in numels]
        # Raw peers move exactly the coalesced payload's bytes.
        self.ag_numel = sum(t.numel() for t in self.shards) * world
        self.rs_numel = sum(-(-n // world) for n in numels) * world
        self.raw_ag_in = torch.randn(self.ag_numel // world, device=device).to(dtype)
        self.raw_ag_out = torch.empty(self.ag_numel, dtype=dtype, device=device)
        self.raw_rs_in = torch.randn(self.rs_numel, device=device).to(dtype)
        self.raw_rs_out = torch.empty(self.rs_numel // world, dtype=dtype, device=device)
        self.dtype = dtype
        self._check()

    def _check(self) -> None:
        # The coalesced results are right before anything is timed.
        outs, handles = all_gather_coalesced(self.group, self.shards)
        wait_all(handles)
        me = self.group.rank
        assert all(torch.equal(o[me], s) for o, s in zip(outs, self.shards, strict=True))
        parts, handles = reduce_scatter_coalesced(self.group, self.full[:1], op="sum")
        wait_all(handles)
        n = parts[0].numel()
        mine = torch.nn.functional.pad(self.full[0], (0, n * self.world - self.full[0].numel()))
        expected = mine[me * n : (me + 1) * n].float() * self.world
        torch.testing.assert_close(parts[0].float(), expected, rtol=2e-2, atol=1e-2)

    def _issuers(self, op: str, g: Group, bucket_bytes: int) -> tuple[Issue, Issue]:
        """(raw, coalesced) calls of `op` on group `g`."""
        if op == "all_gather":

            def raw() -> list[_Waitable]:
                return [
                    _Work(
                        _all_gather_flat(self.raw_ag_out, self.raw_ag_in, group=g.pg, async_op=True)
                    )
                ]

            def coalesced() -> list[Handle]:
                return all_gather_coalesced(g, self.shards, bucket_bytes=bucket_bytes)[1]

        else:

            def raw() -> list[_Waitable]:
                work = _reduce_scatter_flat(
                    self.raw_rs_out, self.raw_rs_in, group=g.pg, async_op=True
                )
                return [_Work(work)]

            def coalesced() -> list[Handle]:
                return reduce_scatter_coalesced(g, self.full, op="sum", bucket_bytes=bucket_bytes)[
                    1
                ]

        return raw, coalesced

    def _pack(self, op: str, bucket_bytes: int) -> tuple[int, Callable[[], None]]:
        """(number of buckets, the packing kernels alone) for `op`."""
        world, rank, device = self.world, self.group.rank, self.shards[0].device
        if op == "all_gather":
            tensors = self.shards
            numels = [t.numel() for t in tensors]
            buckets = _buckets(numels, self.dtype.itemsize, bucket_bytes)
            recvs = [
                torch.empty(world, sum(numels[i] for i in b), dtype=self.dtype, device=device)
                for b in buckets
            ]

            def pack() -> None:
                for b, recv in zip(buckets, recvs, strict=True):
                    _pack_gather_input([tensors[i] for i in b], recv[rank])

            return len(buckets), pack
        tensors = self.full
        parts = [-(-t.numel() // world) for t in tensors]
        buckets = _buckets([p * world for p in parts], self.dtype.itemsize, bucket_bytes)
        sends = [
            torch.empty(world, sum(parts[i] for i in b), dtype=self.dtype, device=device)
            for b in buckets
        ]

        def pack_rs() -> None:
            for b, send in zip(buckets, sends, strict=True):
                _pack_reduce_input([tensors[i] for i in b], [parts[i] for i in b], world, send)

        return len(buckets), pack_rs

    def run(self, op: str, bucket_bytes: int, *, full: bool) -> Row:
        """Time raw and coalesced `op` at this bucket size; `full` adds single and high priority."""
        a, cuda = self.args, self.cuda
        raw, coalesced = self._issuers(op, self.group, bucket_bytes)
        buckets, pack = self._pack(op, bucket_bytes)

        def packed() -> list[_Waitable]:
            pack()
            return []

        streamed = measure(coalesced, 1, a.iters, a.warmup, cuda)
        single = measure(coalesced, 0, a.iters, a.warmup, cuda) if full else None
        raw_hp = streamed_hp = None
        if full and self.high_priority is not None:
            raw2, coalesced2 = self._issuers(op, self.high_priority, bucket_bytes)
            raw_hp = measure(raw2, 1, a.iters, a.warmup, cuda)
            streamed_hp = measure(coalesced2, 1, a.iters, a.warmup, cuda)
        return Row(
            size=self.size,
            op=op,
            tensors=len(self.shards),
            buckets=buckets,
            bucket_bytes=bucket_bytes,
            # Raw collectives queue back to back whether or not each is waited first.
            raw=measure(raw, 1, a.iters, a.warmup, cuda),
            single=single,
            streamed=streamed,
            pack=measure(packed, 0, a.iters, a.warmup, cuda),
            raw_hp=raw_hp,
            streamed_hp=streamed_hp,
        )


def _mib(nbytes: float) -> str:
    return f"{nbytes / MIB:g} MiB"


def _ratio(raw: Timing | None, co: Timing | None) -> float | None:
    return raw.ms / co.ms if raw is not None and co is not None else None


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def report(rows: list[Row], sweep: list[Row], world: int, args: argparse.Namespace) -> str:
    """The markdown body: what was measured, a verdict computed from it, two tables."""
    unit = "GB/s bus bandwidth"
    header = ["size", "op", "tensors", "raw", "single", "streamed", "streamed hp"]
    header += ["ratio single", "ratio streamed", "ratio streamed hp", "pack ms"]
    header += ["host us raw", "host us coalesced"]
    table = []
    for r in rows:
        hp = r.streamed_hp.busbw(r.size, world) if r.streamed_hp else None
        table.append(
            [
                _mib(r.size),
                r.op,
                r.tensors,
                f"{r.raw.busbw(r.size, world):.3g}",
                _fmt(r.single.busbw(r.size, world) if r.single else None, ".3g"),
                f"{r.streamed.busbw(r.size, world):.3g}",
                _fmt(hp, ".3g"),
                _fmt(_ratio(r.raw, r.single)),
                _fmt(_ratio(r.raw, r.streamed)),
                _fmt(_ratio(r.raw_hp, r.streamed_hp)),
                f"{r.pack.ms:.3f}",
                f"{r.raw.host_us:.0f}",
                _fmt(r.single.host_us if r.single else None, ".0f"),
            ]
        )
    big = [r for r in rows if r.size >= 64 * MIB] or [r for r in rows if r.size == rows[-1].size]
    verdict = []
    for op in ("all_gather", "reduce_scatter"):
        mine = [r for r in big if r.op == op]
        if not mine:
            continue
        line = [f"- {op}, sizes >= {_mib(mine[0].size)}:"]
        for name, pairs in (
            ("single", [(r.raw, r.single) for r in mine]),
            ("streamed", [(r.raw, r.streamed) for r in mine]),
            ("streamed hp", [(r.raw_hp, r.streamed_hp) for r in mine]),
        ):
            ratios = [q for raw, co in pairs if (q := _ratio(raw, co)) is not None]
            if ratios:
                met = "meets" if min(ratios) >= GOAL else "misses"
                line.append(
                    f"{name} {min(ratios):.2f} .. {max(ratios):.2f} ({met} the {GOAL} goal);"
                )
        packs = [r.pack.ms / r.raw.ms for r in mine]
        line.append(
            f"the pack alone takes {100 * min(packs):.0f} .. {100 * max(packs):.0f} % of the "
            "raw collective's time, which a single call cannot hide."
        )
        verdict.append(" ".join(line))
    intro = (
        f"{world} ranks, bf16, {unit} = S / time x (n-1)/n, median period between calls "
        f"over {args.iters} calls (slowest rank), one bucket per coalesced call. `single`: "
        "each call waited before the next is packed; `streamed`: the next call issued before "
        "the previous one is waited (as a prefetch or a bucketed backward issues them); "
        "`streamed hp`: the same on a process group with a high-priority NCCL stream "
        "(`pg_options` with `is_high_priority_stream`), its ratio against the raw peer on that "
        "group. "
        "`ratio` is raw time / coalesced time (1.00 = no cost for coalescing); `pack ms` is "
        "the packing kernels alone; `host us` is the host's cost per call. See the docstring "
        "of `benchmarks/comm.py` for the payloads."
    )
    sweep_table = markdown_table(
        ["size", "op", "bucket", "buckets", "streamed", "ratio", "pack ms"],
        [
            [
                _mib(r.size),
                r.op,
                "one" if r.bucket_bytes >= r.size else _mib(r.bucket_bytes),
                r.buckets,
                f"{r.streamed.busbw(r.size, world):.3g}",
                f"{r.raw.ms / r.streamed.ms:.2f}",
                f"{r.pack.ms:.3f}",
            ]
            for r in sweep
        ],
    )
    return (
        f"{intro}\n\n"
        + "\n".join(verdict)
        + f"\n\n{markdown_table(header, table)}\n\n"
        + f"Bucket size sweep (streamed, default-priority stream, {unit}):\n\n{sweep_table}"
    )


def sizes(args: argparse.Namespace) -> list[int]:
    """Powers of two from --min-mib to --max-mib, in bytes."""
    out, s = [], int(args.min_mib * MIB)
    while s <= args.max_mib * MIB:
        out.append(s)
        s *= 2
    return out


def main() -> None:
    """Measure every size on every rank; rank 0 writes the report."""
    args = parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = init_ranks(args.nproc, cuda=cuda)
    world = dist.get_world_size()
    high_priority = None
    if cuda:
        # The same ranks again, with the NCCL stream at high priority.
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = True
        high_priority = Group(dist.new_group(list(range(world)), pg_options=options))
    sweep_buckets = [int(float(m) * MIB) for m in args.sweep_mib.split(",")]
    all_sizes = sizes(args)
    sweep_sizes = [s for s in all_sizes if s >= 64 * MIB] or all_sizes[-1:]
    rows: list[Row] = []
    sweep: list[Row] = []
    start = time.monotonic()
    for size in all_sizes:
        bench = Bench(size, device, cuda, args, high_priority)
        for op in ("all_gather", "reduce_scatter"):
            # One bucket: the coalesced call is one collective, like the raw peer (the
            # reduce-scatter pads each tensor, so allow for it).
            rows.append(bench.run(op, 2 * size, full=True))
            if size in sweep_sizes:
                sweep += [bench.run(op, b, full=False) for b in sweep_buckets if b < size]
                sweep.append(rows[-1])
        del bench
        if cuda:
            torch.cuda.empty_cache()
    sweep.sort(key=lambda r: (r.size, r.op, r.buckets == 1, r.bucket_bytes))
    if dist.get_rank() == 0:
        body = report(rows, sweep, world, args)
        print(body, flush=True)
        print(f"\n({time.monotonic() - start:.0f}s)", flush=True)
        if not args.no_write:
            publish("comm", "Coalesced collectives", body, smoke=args.smoke)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
