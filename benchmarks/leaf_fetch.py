"""Fetch + release of a 64-expert MoE layer: one leaf unit vs per-parameter gathering.

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node=2 -m benchmarks.leaf_fetch
    python -m benchmarks.leaf_fetch --smoke      # relaunches itself on 2 CPU ranks (gloo)

The layer: 64 experts, each two Linear layers d -> 4d -> d with bias (256 parameters;
d 1024 on GPU, 8.4 M parameters per expert, 537 M in all; d 32 with `--smoke`), under a
root that holds the router. Every rank builds the same layer (same seed) three times:
- leaf: zeroshard stage 3 with `leaf_modules=["MoELayer"]`; one fetch + release is the
  engine's own `unit.gather(); unit.release()` on the layer's unit (one flat group,
  one all-gather of the bf16 cast of the fp32 master shard);
- per expert: stage 3 with `unit_modules=["Expert"]`; every expert gathered, then every
  expert released, through the same runtime (64 gathers);
- per parameter: each parameter sharded on its own, fetched with one
  `Group.all_gather_into` per parameter (256) and released per parameter, as a per-tensor
  ZeRO-3 engine does (benchmarks/_leaf_per_param.py; bf16 shards kept resident, so it
  has no cast to do).
Before timing, the gathered parameters of all three are checked bit-equal. Per method:
the host time from the call until fetch + release return (median over `--iters`, the
slowest rank's median), and on GPU the device time between CUDA events around it, the
device synchronized at the end of each iteration (so a host that issues slower than the
device runs shows up here too); `device queued` times the same work with the host
queued far ahead (a sleep kernel holds the stream), i.e. the device's own cost. Full
runs write the "leaf_fetch" section of docs/benchmarks.md; `--smoke` writes
bench-out/leaf_fetch.md only.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zeroshard.engine as zs
from benchmarks._leaf_per_param import PerParameterGather
from benchmarks._report import init_ranks, markdown_table, publish
from zeroshard.comm import Group

MIB = 1024**2
GOAL = 0.3
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU/gloo, small layer, bench-out only")
    p.add_argument("--d", type=int, default=1024, help="expert width (hidden 4d)")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES), help="compute dtype")
    p.add_argument("--iters", type=int, default=50, help="timed iterations per method")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations first")
    p.add_argument("--nproc", type=int, default=2, help="ranks when not launched by torchrun")
    p.add_argument("--no-write", action="store_true", help="print the table, write nothing")
    args = p.parse_args()
    if args.smoke:
        args.d, args.iters, args.warmup = 32, 10, 2
    return args


# -- the model ---------------------------------------------------------------------------
class Expert(nn.Module):
    """d -> 4d -> d with bias."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The expert's MLP."""
        out: torch.Tensor = self.down(F.gelu(self.up(x)))
        return out


class MoELayer(nn.Module):
    """The experts; tokens come routed (top-1 expert index per token)."""

    def __init__(self, d: int, experts: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList([Expert(d) for _ in range(experts)])

    def forward(self, x: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
        """Each token through its chosen expert."""
        out = torch.zeros_like(x)
        for e in torch.unique(choice).tolist():
            mask = choice == e
            out[mask] = self.experts[e](x[mask])
        return out


class Router(nn.Module):
    """The root: a top-1 router and the MoE layer (the router keeps the root a unit)."""

    def __init__(self, d: int, experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d, experts, bias=False)
        self.moe = MoELayer(d, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route each token to its top expert."""
        out: torch.Tensor = self.moe(x, self.gate(x).argmax(-1))
        return out


def build(args: argparse.Namespace, device: torch.device) -> Router:
    """The same layer on every rank and every call (fixed seed)."""
    torch.manual_seed(0)
    with torch.device(device):
        return Router(args.d, args.experts)


# -- timing ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Timing:
    """Slowest rank's medians in ms: host until return, device (synced, queued); nan on CPU."""

    host: float
    device: float
    queued: float


def _event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def _sleep(cycles: int) -> None:
    torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]


@functools.cache
def _sleep_cycles_per_ms() -> float:
    start, end = _event(), _event()
    start.record()
    _sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    return 10_000_000 / float(start.elapsed_time(end))


def measure(fn: Callable[[], None], iters: int, warmup: int, cuda: bool) -> Timing:
    """Median host and device time of `fn` (see the module doc), slowest rank."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    host: list[float] = []
    device: list[float] = []
    for _ in range(iters):
        if cuda:
            start, end = _event(), _event()
            start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        if cuda:
            end.record()
            torch.cuda.synchronize()
            device.append(start.elapsed_time(end))
    queued = math.nan
    if cuda:
        dist.barrier()
        starts = [_event() for _ in range(iters)]
        ends = [_event() for _ in range(iters)]
        # The sleep covers queueing every iteration (2x margin, + 1 ms), so the events
        # time the device's work back to back, not gaps waiting for the host.
        ms = 2 * iters * statistics.median(host) + 1
        _sleep(int(_sleep_cycles_per_ms() * ms))
        for s, e in zip(starts, ends, strict=True):
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        queued = statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))
    stats = torch.tensor(
        [statistics.median(host), statistics.median(device) if cuda else math.nan, queued],
        dtype=torch.float64,
        device="cuda" if cuda else "cpu",
    )
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return Timing(float(stats[0]), float(stats[1]), float(stats[2]))


# -- the three methods -------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """One method's result."""

    method: str
    gathers: int
    collectives: int
    nbytes: int
    timing: Timing


def _engine(args: argparse.Namespace, device: torch.device, config: dict[str, object]) -> Router:
    model = build(args, device)
    cfg = {"stage": 3, "compute_dtype": args.dtype, "persistence_threshold": 0, **config}
    # initialize() returns the same module, hooked; keep the precise type.
    zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.0), cfg)
    return model


def _check_equal(model: Router, peer: PerParameterGather, what: str) -> None:
    """Every gathered parameter of `model.moe` equals the per-parameter gather's, bit for bit."""
    mine = list(model.moe.parameters())
    assert len(mine) == len(peer.params), what
    for i, (a, b) in enumerate(zip(mine, peer.params, strict=True)):
        if a.shape != b.shape or not torch.equal(a.data, b.data):
            raise AssertionError(f"{what}: parameter {i} differs from the per-parameter gather")


def run(args: argparse.Namespace, device: torch.device, cuda: bool) -> list[Row]:
    """Build the three methods, check they gather the same values, time each."""
    dtype = DTYPES[args.dtype]
    group = Group()
    # Per parameter: shards of a fresh copy of the layer; its full weights are then freed.
    plain = build(args, device)
    peer = PerParameterGather(list(plain.moe.named_parameters()), group, dtype)
    for p in plain.parameters():
        p.data = torch.empty(0, device=device)

    leaf_model = _engine(args, device, {"leaf_modules": ["MoELayer"]})
    leaf_rt = zs.engine_state(leaf_model).stage3
    assert leaf_rt is not None
    leaf = next(u for u in leaf_rt.units if u.module is leaf_model.moe)

    expert_model = _engine(args, device, {"unit_modules": ["Expert"]})
    expert_rt = zs.engine_state(expert_model).stage3
    assert expert_rt is not None
    experts = [u for u in expert_rt.units if isinstance(u.module, Expert)]
    assert len(experts) == args.experts

    def fetch_leaf() -> None:
        leaf.gather()
        leaf.release()

    def fetch_experts() -> None:
        for u in experts:
            u.gather()
        for u in experts:
            u.release()

    def fetch_params() -> None:
        peer.fetch()
        peer.release()

    # The same bits everywhere before anything is timed.
    peer.fetch()
    leaf.gather()
    _check_equal(leaf_model, peer, "leaf")
    leaf.release()
    for u in experts:
        u.gather()
    _check_equal(expert_model, peer, "per expert")
    for u in experts:
        u.release()
    peer.release()

    # On gloo the engine checks each gather's unit with a tiny all-reduce first (see
    # [Note: divergent ranks] in the engine's _stage3.py); on NCCL it does not.
    check = int(group.backend != "nccl")
    rows = []
    for method, rt, units, fn in (
        ("leaf unit (engine)", leaf_rt, [leaf], fetch_leaf),
        ("unit per expert (engine)", expert_rt, experts, fetch_experts),
    ):
        rt.stats.reset()
        fn()
        assert rt.stats.gathers == len(units), (method, rt.stats.gathers)
        collectives = sum(len(u.groups) + check for u in units)
        nbytes = rt.stats.bytes_gathered
        rows.append(Row(method, len(units), collectives, nbytes, measure_fn(fn, args, cuda)))
    n = len(peer.params)
    rows.append(
        Row("per parameter", n, n, peer.gathered_bytes, measure_fn(fetch_params, args, cuda))
    )
    return rows


def measure_fn(fn: Callable[[], None], args: argparse.Namespace, cuda: bool) -> Timing:
    """`measure` with the command line's iteration counts."""
    return measure(fn, args.iters, args.warmup, cuda)


# -- the report --------------------------------------------------------------------------
def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.3f}"


def _ratio(a: float, b: float) -> str:
    return "-" if math.isnan(a) or math.isnan(b) else f"{a / b:.2f}"


def report(rows: list[Row], world: int, args: argparse.Namespace, cuda: bool) -> str:
    """The markdown body: setup, verdict against the goal, one table."""
    leaf, expert, peer = rows
    params = args.experts * (8 * args.d * args.d + 5 * args.d)
    host_ratio = leaf.timing.host / peer.timing.host
    met = "meets" if host_ratio <= GOAL else "misses"
    verdict = [
        f"- host time, leaf / per parameter = {host_ratio:.2f} ({met} the <= {GOAL} goal); "
        f"unit per expert / per parameter = {expert.timing.host / peer.timing.host:.2f}."
    ]
    if cuda:
        verdict.append(
            f"- device time (synchronized), leaf / per parameter = "
            f"{_ratio(leaf.timing.device, peer.timing.device)}; with the host queued ahead "
            f"= {_ratio(leaf.timing.queued, peer.timing.queued)}."
        )
    header = ["method", "gathers", "collectives", "MiB gathered", "host ms", "device ms"]
    header += ["device queued ms", "host / per param", "device / per param"]
    table = [
        [
            r.method,
            r.gathers,
            r.collectives,
            f"{r.nbytes / MIB:.1f}",
            _ms(r.timing.host),
            _ms(r.timing.device),
            _ms(r.timing.queued),
            _ratio(r.timing.host, peer.timing.host),
            _ratio(r.timing.device, peer.timing.device),
        ]
        for r in rows
    ]
    where = "NCCL" if cuda else "gloo (CPU)"
    intro = (
        f"{world} ranks on {where}; an MoE layer of {args.experts} experts (d {args.d} -> "
        f"{4 * args.d} -> {args.d}, with bias: {4 * args.experts} parameters, {params / 1e6:.1f} M "
        f"elements), {args.dtype} gathers. One fetch + release of the whole layer, median of "
        f"{args.iters} iterations after {args.warmup} warm-up (slowest rank). `host ms`: "
        "from the call until gather + release return; `device ms`: CUDA events around the "
        "same, the device synchronized at the end of each iteration; `device queued ms`: "
        "the host queued ahead, so only the device's own work counts. The leaf and "
        "per-expert rows go through the engine's units (`unit.gather(); "
        "unit.release()`), which also casts its fp32 master shard to the compute dtype "
        "before each gather; the per-parameter row keeps resident compute-dtype shards, as "
        "per-tensor engines do, so it has no cast. `collectives` counts all-gathers, plus "
        "the engine's per-gather unit check on gloo. See the docstring of "
        "`benchmarks/leaf_fetch.py`."
    )
    return f"{intro}\n\n" + "\n".join(verdict) + f"\n\n{markdown_table(header, table)}"


def main() -> None:
    """Measure on every rank; rank 0 writes the report."""
    args = parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = init_ranks(args.nproc, cuda=cuda)
    start = time.monotonic()
    rows = run(args, device, cuda)
    if dist.get_rank() == 0:
        body = report(rows, dist.get_world_size(), args, cuda)
        print(body, flush=True)
        print(f"\n({time.monotonic() - start:.0f}s)", flush=True)
        if not args.no_write:
            publish("leaf_fetch", "Leaf-module fetch of an MoE layer", body, smoke=args.smoke)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
