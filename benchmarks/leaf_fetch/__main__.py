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
  ZeRO-3 engine does (`_per_param.py`; bf16 shards kept resident, so it
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
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import zeroshard.engine as zs
from benchmarks._common import init_ranks, publish
from benchmarks.leaf_fetch._model import Expert, Router, build
from benchmarks.leaf_fetch._per_param import PerParameterGather
from benchmarks.leaf_fetch._report import Row, report
from benchmarks.leaf_fetch._timing import Timing, measure
from zeroshard.comm import Group

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
    # [Note: divergent ranks] in the engine's runtime/_stage3.py); on NCCL it does not.
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


def main() -> None:
    """Measure on every rank; rank 0 writes the report."""
    args = parse_args()
    placement, device = init_ranks(args.nproc, smoke=args.smoke)
    if dist.get_rank() == 0:
        print(f"[leaf_fetch] ranks: {placement.describe()}", flush=True)
    start = time.monotonic()
    rows = run(args, device, placement.on_gpus)
    if dist.get_rank() == 0:
        body = report(rows, placement.describe(), args, placement.on_gpus)
        print(body, flush=True)
        print(f"\n({time.monotonic() - start:.0f}s)", flush=True)
        if not args.no_write:
            title = "Leaf-module fetch of an MoE layer"
            publish("leaf_fetch", title, body, smoke=args.smoke, ranks=placement.describe())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
