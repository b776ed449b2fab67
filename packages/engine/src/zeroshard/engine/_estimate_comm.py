"""Collective times from an alpha-beta (latency-bandwidth) model of a GPU cluster.

A ring all-gather or reduce-scatter of S bytes over n ranks takes n - 1 steps, each
moving S / n bytes over the slowest link of the ring and paying that link's latency:
t = (n - 1) * alpha + (n - 1) / n * S / B. An all-reduce is a reduce-scatter and an
all-gather. A ring inside one node runs over NVLink; one that crosses nodes is paced by
the inter-node link (bandwidth per GPU, as a NIC per GPU gives).
"""

from __future__ import annotations

from dataclasses import dataclass

# Fitted by `benchmarks/plan_validation.py` (least squares on t = alpha + S' / B with
# S' = S (n-1)/n) to the `raw` column of the "Coalesced collectives" table of
# docs/benchmarks.md (2 x NVIDIA H200, 2026-11-22, sizes 1 MiB .. 1 GiB, all-gather and
# reduce-scatter together); `tests/engine/test_estimate_comm.py` refits and compares.
NVLINK_GBPS_FIT = 265.2
NVLINK_LATENCY_US_FIT = 32.2


@dataclass(frozen=True)
class Link:
    """One kind of link: bandwidth in GB/s (bus bandwidth per GPU) and latency per step."""

    gbps: float
    latency_us: float

    def __post_init__(self) -> None:
        if not self.gbps > 0 or self.latency_us < 0:
            raise ValueError(f"a link needs gbps > 0 and latency_us >= 0, got {self}")


@dataclass(frozen=True)
class Cluster:
    """GPUs per node and the two kinds of link between them.

    Attributes:
        gpus_per_node: GPUs sharing one NVLink domain.
        nvlink: intra-node link; default fitted to the measured 2-GPU curves (see above).
        internode: inter-node link per GPU; default 400 Gb/s = 50 GB/s, 5 us per step
            (an input, not a measurement: no multi-node run was available).
    """

    gpus_per_node: int = 8
    nvlink: Link = Link(NVLINK_GBPS_FIT, NVLINK_LATENCY_US_FIT)
    internode: Link = Link(50.0, 5.0)

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

    def all_gather_s(self, nbytes: int, ranks: int, stride: int = 1) -> float:
        """Seconds to all-gather `nbytes` (the gathered size) over `ranks` ranks."""
        if ranks <= 1:
            return 0.0
        link = self.link(ranks, stride)
        return (ranks - 1) * link.latency_us * 1e-6 + (ranks - 1) / ranks * nbytes / (
            link.gbps * 1e9
        )

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
