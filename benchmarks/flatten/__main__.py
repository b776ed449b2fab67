"""Time and peak memory of each flattening tier for the parameters of a ~1B GPT.

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node=2 -m benchmarks.flatten
    python -m benchmarks.flatten --smoke      # relaunches itself on 2 CPU ranks (gloo)
    python -m benchmarks.flatten --layers 8 --repeats 7 --section flatten_cpu   # CPU host

The parameter layout is a GPT-2-style model with d 2048 and 20 layers (1.11 B
parameters, bf16); `--smoke` uses d 512 and 4 layers in fp32 on the CPU. Every rank
builds the same parameters and flattens them with each method in turn: `torch.cat`
(the naive copy, the peer every ratio is against), then zeroshard's DEVICE, CPU and
DISTRIBUTED tiers. Per method: median time over `--repeats` (the slowest rank,
synchronized), the peak memory above what was in use before the parameters existed
(GPU: torch.cuda.max_memory_allocated; host: peak RSS from /proc), and that peak as a
multiple of the parameters' own size. Full runs write the "flatten" section (or
`--section`) of docs/benchmarks.md; `--smoke` writes bench-out/<section>.md only. Without
a GPU for every rank the ranks run on the host (gloo, the cores shared between them; the
report says so): fewer `--layers` make the layout fit a host where every rank holds its
own copy.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.distributed as dist

from benchmarks._common import init_ranks, publish
from benchmarks.flatten._measure import measure, torch_cat
from benchmarks.flatten._memory import return_freed_host_memory
from benchmarks.flatten._report import report
from zeroshard.comm import Group
from zeroshard.partition import FlatLayout, FlattenTier, flatten_params

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="small GPT on CPU/gloo, bench-out only")
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--dtype", default=None, choices=list(DTYPES), help="bf16 (fp32 in --smoke)")
    p.add_argument("--alignment", type=int, default=64, help="slot alignment in elements")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per method")
    p.add_argument("--nproc", type=int, default=2, help="ranks when not launched by torchrun")
    p.add_argument("--no-write", action="store_true", help="print the table, write nothing")
    p.add_argument("--section", default="flatten", help="docs/benchmarks.md section to write")
    args = p.parse_args()
    if args.smoke:
        args.d_model, args.layers, args.vocab, args.seq_len = 512, 4, 4096, 256
    return args


def gpt_shapes(d: int, layers: int, vocab: int, seq_len: int) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes of a GPT-2-style decoder (biases, learned positions)."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("wte", (vocab, d)), ("wpe", (seq_len, d))]
    for i in range(layers):
        b = f"h.{i}."
        shapes += [
            (b + "ln_1.weight", (d,)),
            (b + "ln_1.bias", (d,)),
            (b + "attn.qkv.weight", (3 * d, d)),
            (b + "attn.qkv.bias", (3 * d,)),
            (b + "attn.proj.weight", (d, d)),
            (b + "attn.proj.bias", (d,)),
            (b + "ln_2.weight", (d,)),
            (b + "ln_2.bias", (d,)),
            (b + "mlp.fc.weight", (4 * d, d)),
            (b + "mlp.fc.bias", (4 * d,)),
            (b + "mlp.proj.weight", (d, 4 * d)),
            (b + "mlp.proj.bias", (d,)),
        ]
    return [*shapes, ("ln_f.weight", (d,)), ("ln_f.bias", (d,))]


def main() -> None:
    """Run every method in turn on every rank; rank 0 writes the report."""
    args = parse_args()
    placement, device = init_ranks(args.nproc, smoke=args.smoke)
    if dist.get_rank() == 0:
        print(f"[flatten] ranks: {placement.describe()}", flush=True)
    return_freed_host_memory()
    world = dist.get_world_size()
    dtype = DTYPES[args.dtype or ("fp32" if args.smoke else "bf16")]
    shapes = gpt_shapes(args.d_model, args.layers, args.vocab, args.seq_len)
    layout = FlatLayout.build(shapes, dtype, world, alignment=args.alignment)
    group = Group()

    def tier(t: FlattenTier) -> Callable[[list[torch.Tensor]], torch.Tensor]:
        return lambda ps: flatten_params(ps, layout, device=device, tier=t, group=group)[0]

    methods: dict[str, Callable[[list[torch.Tensor]], torch.Tensor]] = {
        "torch.cat": lambda ps: torch_cat(ps, layout),
        "DEVICE": tier(FlattenTier.DEVICE),
        "CPU": tier(FlattenTier.CPU),
        "DISTRIBUTED": tier(FlattenTier.DISTRIBUTED),
    }
    # One untimed pass warms the allocator, NCCL and the pinned-memory pool.
    for run in methods.values():
        measure("warm-up", run, layout, device, 1)
    results = {n: measure(n, run, layout, device, args.repeats) for n, run in methods.items()}
    if len({r["fingerprint"] for r in results.values()}) != 1:
        raise RuntimeError(f"methods packed different bytes: {results}")
    if dist.get_rank() == 0:
        body = report(results, layout, device, placement.describe(), args)
        print(body, flush=True)
        if not args.no_write:
            title = "Flattening tiers" + ("" if placement.on_gpus else " on the CPU host (gloo)")
            publish(args.section, title, body, smoke=args.smoke, ranks=placement.describe())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
