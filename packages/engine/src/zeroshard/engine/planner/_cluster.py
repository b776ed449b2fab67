"""Collective times from an alpha-beta (latency-bandwidth) model of a GPU cluster.

A ring all-gather or reduce-scatter of S bytes over n ranks pays a fixed cost per
collective (launch and synchronization, fitted), n - 1 hop latencies, and moves
(n - 1) / n * S bytes over the slowest link of the ring:
t = overhead + (n - 1) * hop + (n - 1) / n * S / B. An all-reduce is a reduce-scatter and
an all-gather. A ring inside one node runs over NVLink (whose hop latency is folded into
the fitted overhead: the fit is of 2-GPU curves, one hop); one that crosses nodes is
paced by the inter-node link (bandwidth per GPU, as one NIC per GPU gives).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Fitted by `benchmarks/plan_validation` (least squares on t = alpha + S' / B with
# S' = S (n-1)/n) to the raw NCCL curves in benchmarks/results/nccl_raw_2gpu.json (the
# machine and sizes: docs/benchmarks.md, design-measurements);
# `tests/engine/test_estimate_cli.py` refits and compares.
NVLINK_GBPS_FIT = 265.2
NVLINK_LATENCY_US_FIT = 32.2


@dataclass(frozen=True)
class Link:
    """One kind of link: bandwidth in GB/s (bus bandwidth per GPU) and latency per hop."""

    gbps: float
    latency_us: float

    def __post_init__(self) -> None:
        if not self.gbps > 0 or self.latency_us < 0:
            raise ValueError(f"a link needs gbps > 0 and latency_us >= 0, got {self}")


@dataclass(frozen=True)
class Cluster:
    """GPUs per node, the two kinds of link between them and the cost of a collective.

    Attributes:
        gpus_per_node: GPUs sharing one NVLink domain.
        nvlink: intra-node bandwidth, fitted to the measured 2-GPU curves (see above).
        internode: inter-node link per GPU; default 400 Gb/s = 50 GB/s and 5 us per hop
            (inputs, not measurements: no multi-node run was available).
        overhead_us: fixed cost of one collective, fitted with `nvlink`.
    """

    gpus_per_node: int = 8
    nvlink: Link = field(default_factory=lambda: Link(NVLINK_GBPS_FIT, 0.0))
    internode: Link = field(default_factory=lambda: Link(50.0, 5.0))
    overhead_us: float = NVLINK_LATENCY_US_FIT

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")

    def link(self, ranks: int, stride: int = 1) -> Link:
        """The link pacing a ring of `ranks` ranks spaced `stride` apart (consecutive: 1)."""
        if ranks * stride <= self.gpus_per_node:
            return self.nvlink
        return Link(
            min(self.nvlink.gbps, self.internode.gbps),
            max(self.nvlink.latency_us, self.internode.latency_us),
        )

    def latency_s(self, ranks: int, stride: int = 1) -> float:
        """The size-independent part of one ring collective over `ranks` ranks."""
        if ranks <= 1:
            return 0.0
        return (self.overhead_us + (ranks - 1) * self.link(ranks, stride).latency_us) * 1e-6

    def all_gather_s(self, nbytes: int, ranks: int, stride: int = 1) -> float:
        """Seconds to all-gather `nbytes` (the gathered size) over `ranks` ranks."""
        if ranks <= 1:
            return 0.0
        bandwidth = self.link(ranks, stride).gbps * 1e9
        return self.latency_s(ranks, stride) + (ranks - 1) / ranks * nbytes / bandwidth

    def reduce_scatter_s(self, nbytes: int, ranks: int, stride: int = 1) -> float:
        """Seconds to reduce-scatter `nbytes` (the input size) over `ranks` ranks."""
        return self.all_gather_s(nbytes, ranks, stride)

    def all_reduce_s(self, nbytes: int, ranks: int, stride: int = 1) -> float:
        """Seconds to all-reduce `nbytes` over `ranks` ranks (reduce-scatter + all-gather)."""
        return 2 * self.all_gather_s(nbytes, ranks, stride)


def fit_link(sizes: list[int], seconds: list[float]) -> Link:
    """Least-squares alpha and bandwidth from (bytes moved per rank, seconds) pairs."""
    n = len(sizes)
    if n < 2 or len(seconds) != n:
        raise ValueError("fit_link needs at least two (size, seconds) pairs of equal length")
    mx, my = sum(sizes) / n, sum(seconds) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, seconds, strict=True)) / sxx
    alpha = my - slope * mx
    return Link(1 / slope / 1e9, max(0.0, alpha) * 1e6)
