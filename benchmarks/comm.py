"""Bus bandwidth of zeroshard's coalesced all-gather / reduce-scatter against raw collectives.

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node=2 benchmarks/comm.py
    python benchmarks/comm.py --smoke      # relaunches itself on 2 CPU ranks (gloo)

For every size S (1 MiB .. 1 GiB, bf16) the payload is the parameters of 4 transformer
blocks (LayerNorms, QKV, projection, MLP up and down, their biases: 48 tensors of mixed
sizes, plus one remainder so the total is exactly S). Coalesced all-gather: each rank
holds a 1/world shard of every tensor and `all_gather_coalesced` packs, gathers and
unpacks (views) them; the peer is one raw `all_gather_into_tensor` of a preallocated
buffer of the same total size (S is the gathered bytes). Coalesced reduce-scatter: each
rank holds the full tensors (S bytes) and `reduce_scatter_coalesced` packs (zero-pads,
interleaves), reduce-scatters and unpacks them; the peer is one raw
`reduce_scatter_tensor` of an S-byte buffer. Bus bandwidth is S / time * (n-1)/n; time
is the median over `--iters` iterations timed with CUDA events (the slowest rank's
median). `pack` is the packing kernel(s) alone, timed the same way: the part of the
coalesced path that the raw peer does not do. A second table sweeps the bucket size at
>= 64 MiB, where the goal is coalesced >= 0.95 x raw. Full runs write the "comm" section
of docs/benchmarks.md; `--smoke` (CPU, gloo, small sizes) writes bench-out/comm.md only.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from zeroshard.comm import (
    DEFAULT_BUCKET_BYTES,
    Group,
    all_gather_coalesced,
    reduce_scatter_coalesced,
    wait_all,
)
from zeroshard.comm._coalesce import _buckets, _pack_reduce_input

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import init_ranks, markdown_table, publish

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
    p.add_argument("--bucket-mib", type=float, default=DEFAULT_BUCKET_BYTES / MIB)
    p.add_argument(
        "--sweep-mib",
        default="16,32,64,128,256",
        help="bucket sizes (MiB) for the sweep table, at sizes >= 64 MiB",
    )
    p.add_argument("--nproc", type=int, default=2, help="ranks when not launched by torchrun")
    p.add_argument("--no-write", action="store_true", help="print the tables, write nothing")
    args = p.parse_args()
    if args.smoke:
        args.min_mib, args.max_mib, args.iters, args.warmup = 0.25, 4.0, 5, 1
        args.bucket_mib, args.sweep_mib = 1.0, "0.5,1,2"
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
    """Slowest rank's median device milliseconds, and host microseconds per call."""

    ms: float
    host_us: float

    def busbw(self, nbytes: int, world: int) -> float:
        """Bus bandwidth in GB/s for `nbytes` moved in this time."""
        return nbytes / (self.ms / 1e3) * (world - 1) / world / 1e9 if world > 1 else 0.0


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


def measure(fn: Callable[[], None], iters: int, warmup: int, cuda: bool) -> Timing:
    """Median per-iteration time of `fn` and its host cost per call, slowest rank.

    On CUDA a sleep kernel first holds the stream while the host queues every iteration,
    so the per-iteration CUDA events time the device's work back to back, not the gaps
    in which the GPU waits for the host; the host's own cost is reported apart.
    """
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    host_us = (time.perf_counter() - t0) / 3 * 1e6
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    times: list[float] = []
    if cuda:
        new_event = torch.cuda.Event
        starts = [new_event(enable_timing=True) for _ in range(iters)]  # type: ignore[no-untyped-call]
        ends = [new_event(enable_timing=True) for _ in range(iters)]  # type: ignore[no-untyped-call]
        # Enough sleep to cover queueing all iterations, with a 2x margin, plus 1 ms.
        cycles = int(_cycles_per_ms() * (2 * iters * host_us / 1e3 + 1))
        torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]
        for s, e in zip(starts, ends, strict=True):
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    stats = torch.tensor([statistics.median(times), host_us], dtype=torch.float64)
    if cuda:
        stats = stats.cuda()
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return Timing(float(stats[0]), float(stats[1]))


@dataclass(frozen=True)
class Row:
    """One (size, op, bucket size) result."""

    size: int
    op: str
    tensors: int
    buckets: int
    bucket_bytes: int
    raw: Timing
    coalesced: Timing
    pack: Timing


class Bench:
    """Tensors and closures for one size S on this rank."""

    def __init__(self, size: int, device: torch.device, cuda: bool, args: argparse.Namespace):
        self.size, self.cuda, self.args = size, cuda, args
        self.group = Group()
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

    def run(self, op: str, bucket_bytes: int) -> Row:
        """Time raw, coalesced and pack-only for `op` at this bucket size."""
        g, a = self.group, self.args
        if op == "all_gather":
            tensors, itemsize = self.shards, self.dtype.itemsize
            numels = [t.numel() for t in tensors]
            buckets = _buckets(numels, itemsize, bucket_bytes)
            sends = [
                torch.empty(sum(numels[i] for i in b), dtype=self.dtype, device=tensors[0].device)
                for b in buckets
            ]

            def raw() -> None:
                _all_gather_flat(self.raw_ag_out, self.raw_ag_in)

            def coalesced() -> None:
                _, handles = all_gather_coalesced(g, tensors, bucket_bytes=bucket_bytes)
                wait_all(handles)

            def pack() -> None:
                for b, send in zip(buckets, sends, strict=True):
                    dests = send.split_with_sizes([numels[i] for i in b])
                    torch._foreach_copy_(list(dests), [tensors[i] for i in b])

        else:
            tensors, world = self.full, self.world
            parts = [-(-t.numel() // world) for t in tensors]
            buckets = _buckets([p * world for p in parts], self.dtype.itemsize, bucket_bytes)
            sends = [
                torch.empty(
                    world, sum(parts[i] for i in b), dtype=self.dtype, device=tensors[0].device
                )
                for b in buckets
            ]

            def raw() -> None:
                _reduce_scatter_flat(self.raw_rs_out, self.raw_rs_in)

            def coalesced() -> None:
                _, handles = reduce_scatter_coalesced(
                    g, tensors, op="sum", bucket_bytes=bucket_bytes
                )
                wait_all(handles)

            def pack() -> None:
                for b, send in zip(buckets, sends, strict=True):
                    _pack_reduce_input([tensors[i] for i in b], [parts[i] for i in b], world, send)

        return Row(
            size=self.size,
            op=op,
            tensors=len(tensors),
            buckets=len(buckets),
            bucket_bytes=bucket_bytes,
            raw=measure(raw, a.iters, a.warmup, self.cuda),
            coalesced=measure(coalesced, a.iters, a.warmup, self.cuda),
            pack=measure(pack, a.iters, a.warmup, self.cuda),
        )


def _mib(nbytes: float) -> str:
    return f"{nbytes / MIB:g} MiB"


def report(rows: list[Row], sweep: list[Row], world: int, args: argparse.Namespace) -> str:
    """The markdown body: what was measured, a verdict computed from it, two tables."""
    unit = "GB/s bus bandwidth"
    header = ["size", "op", "tensors", "buckets", "raw", "coalesced", "ratio", "pack ms", "pack %"]
    header += ["host us raw", "host us coalesced"]
    table = []
    for r in rows:
        raw_bw = r.raw.busbw(r.size, world)
        co_bw = r.coalesced.busbw(r.size, world)
        table.append(
            [
                _mib(r.size),
                r.op,
                r.tensors,
                r.buckets,
                f"{raw_bw:.3g}",
                f"{co_bw:.3g}",
                f"{r.raw.ms / r.coalesced.ms:.2f}",
                f"{r.pack.ms:.3f}",
                f"{100 * r.pack.ms / r.coalesced.ms:.0f}",
                f"{r.raw.host_us:.0f}",
                f"{r.coalesced.host_us:.0f}",
            ]
        )
    big = [r for r in rows if r.size >= 64 * MIB]
    big = big or [r for r in rows if r.size == rows[-1].size]
    verdict = []
    for op in ("all_gather", "reduce_scatter"):
        mine = [r for r in big if r.op == op]
        if not mine:
            continue
        ratios = [r.raw.ms / r.coalesced.ms for r in mine]
        # Share of the coalesced time that raw does not spend, and the pack's share.
        gaps = [1 - q for q in ratios]
        packs = [r.pack.ms / r.coalesced.ms for r in mine]
        met = "meets" if min(ratios) >= GOAL else "misses"
        why = ""
        if min(ratios) < GOAL:
            explained = sum(min(p, g) for p, g in zip(packs, gaps, strict=True))
            share = explained / max(sum(g for g in gaps if g > 0), 1e-12)
            why = f"; packing time covers {100 * share:.0f} % of the gap, so " + (
                "packing is what limits it" if share >= 0.5 else "packing is not the limit"
            )
        verdict.append(
            f"- {op}, sizes >= {_mib(mine[0].size)}: coalesced / raw = "
            f"{min(ratios):.2f} .. {max(ratios):.2f} ({met} the {GOAL} goal); the pack "
            f"alone takes {100 * min(packs):.0f} .. {100 * max(packs):.0f} % of the "
            f"coalesced time{why}."
        )
    intro = (
        f"{world} ranks, bf16, {unit} = S / time x (n-1)/n, median of {args.iters} "
        f"iterations (slowest rank), default bucket {_mib(args.bucket_mib * MIB)}. `ratio` is "
        "raw time / coalesced time (1.00 = no cost for coalescing); `pack %` is the packing "
        "kernels' time alone as a share of the coalesced time (packing overlaps the previous "
        "bucket's collective, so it only costs what does not overlap). Device times are taken "
        "with the host queueing ahead (as in training); `host us` is the host's cost per call, "
        "which bounds the rate when nothing else is queued. See the docstring of "
        "`benchmarks/comm.py` for the payloads."
    )
    sweep_table = markdown_table(
        ["size", "op", "bucket", "buckets", "coalesced", "ratio", "pack ms"],
        [
            [
                _mib(r.size),
                r.op,
                _mib(r.bucket_bytes),
                r.buckets,
                f"{r.coalesced.busbw(r.size, world):.3g}",
                f"{r.raw.ms / r.coalesced.ms:.2f}",
                f"{r.pack.ms:.3f}",
            ]
            for r in sweep
        ],
    )
    return (
        f"{intro}\n\n"
        + "\n".join(verdict)
        + f"\n\n{markdown_table(header, table)}\n\n"
        + f"Bucket size sweep ({unit}):\n\n{sweep_table}"
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
    bucket = int(args.bucket_mib * MIB)
    sweep_buckets = [int(float(m) * MIB) for m in args.sweep_mib.split(",")]
    all_sizes = sizes(args)
    sweep_sizes = [s for s in all_sizes if s >= 64 * MIB] or all_sizes[-1:]
    rows: list[Row] = []
    sweep: list[Row] = []
    start = time.monotonic()
    for size in all_sizes:
        bench = Bench(size, device, cuda, args)
        for op in ("all_gather", "reduce_scatter"):
            rows.append(bench.run(op, bucket))
            if size in sweep_sizes:
                sweep += [bench.run(op, b) for b in sweep_buckets if b != bucket]
                sweep.append(rows[-1])
        del bench
        if cuda:
            torch.cuda.empty_cache()
    sweep.sort(key=lambda r: (r.size, r.op, r.bucket_bytes))
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
