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
a GPU the ranks run on the host (gloo, one thread each): fewer `--layers` make the layout
fit a host where every rank holds its own copy.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from benchmarks._report import init_ranks, markdown_table, publish
from zeroshard.comm import Group
from zeroshard.partition import FlatLayout, FlattenTier, flatten_params

GIB = 1024**3
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


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


class Meter:
    """Current and peak memory of this process: CUDA allocator on a GPU, RSS on the host."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host_ok = True

    def reset(self) -> None:
        """Start a new peak from the current level."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        # Writing 5 resets the kernel's peak-RSS mark (VmHWM) to the current RSS; where
        # that is not allowed, host peaks are reported as n/a rather than guessed.
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.host_ok = False

    def device_now(self) -> int:
        """Bytes in use on the device (the host RSS on a CPU device)."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return _status_bytes("VmRSS")

    def device_peak(self) -> float:
        """Peak bytes on the device since `reset()`."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return self.host_peak()

    @staticmethod
    def host_now() -> int:
        """Resident host memory now."""
        return _status_bytes("VmRSS")

    def host_peak(self) -> float:
        """Peak resident host memory since `reset()` (NaN where it cannot be reset)."""
        return _status_bytes("VmHWM") if self.host_ok else math.nan


def _return_freed_host_memory() -> None:
    """Make glibc serve every allocation over 64 KiB from mmap, so a free returns it.

    Otherwise freed heap memory stays resident and the next method's RSS peak is hidden
    inside it: host peaks would be meaningless.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_mmap_threshold = -3
    libc.mallopt(m_mmap_threshold, 64 * 1024)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _make_params(layout: FlatLayout, device: torch.device) -> list[torch.Tensor]:
    # The same seed on every rank: replicated parameters, as the DISTRIBUTED tier requires.
    gen = torch.Generator(device=device).manual_seed(0)
    return [
        torch.randn(s.shape, dtype=layout.dtype, device=device, generator=gen) for s in layout.slots
    ]


def _torch_cat(params: list[torch.Tensor], layout: FlatLayout) -> torch.Tensor:
    """The naive flatten: one torch.cat, then every param re-pointed at its view."""
    with torch.no_grad():
        flat = torch.cat([p.reshape(-1) for p in params])
    off = 0
    for p in params:
        p.data = flat[off : off + p.numel()].view(p.shape)
        off += p.numel()
    return flat


def _fingerprint(flat: torch.Tensor) -> int:
    """Sum of the buffer's bytes: equal for every method that packed the same values
    (zero padding adds nothing)."""
    return int(flat.view(torch.uint8).sum(dtype=torch.int64).item())


def measure(
    name: str,
    run: Callable[[list[torch.Tensor]], torch.Tensor],
    layout: FlatLayout,
    device: torch.device,
    repeats: int,
) -> dict[str, float]:
    """Median time and peaks of `run` over fresh parameters, max over ranks."""
    meter = Meter(device)
    times, dev_peaks, host_peaks, prints = [], [], [], set()
    for _ in range(repeats):
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        dev_base, host_base = meter.device_now(), meter.host_now()
        params = _make_params(layout, device)
        _sync(device)
        dist.barrier()  # every rank starts together: the DISTRIBUTED tier waits on peers
        meter.reset()
        t0 = time.perf_counter()
        flat = run(params)
        _sync(device)
        times.append(time.perf_counter() - t0)
        dev_peaks.append(meter.device_peak() - dev_base)
        host_peaks.append(meter.host_peak() - host_base)
        prints.add(_fingerprint(flat))
        del flat, params
    if len(prints) != 1:
        raise RuntimeError(f"{name}: repeats packed different bytes")
    figures = [statistics.median(times), max(dev_peaks), max(host_peaks), prints.pop()]
    t = torch.tensor(figures, dtype=torch.float64, device=Group().device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(("time_s", "device_peak", "host_peak", "fingerprint"), t.tolist(), strict=True))


def _num(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.2f}"


def report(
    results: dict[str, dict[str, float]],
    layout: FlatLayout,
    device: torch.device,
    world: int,
    args: argparse.Namespace,
) -> str:
    """The markdown body: what was measured and one row per method."""
    model_bytes = layout.numel * layout.dtype.itemsize
    base = results["torch.cat"]
    on_gpu = device.type == "cuda"
    header = ["method", "time (ms)", "time vs torch.cat", "peak (GiB)", "peak / params"]
    if on_gpu:
        header += ["peak vs torch.cat", "host peak (GiB)"]
    else:
        header += ["peak vs torch.cat"]
    rows: list[list[object]] = []
    for name, r in results.items():
        row: list[object] = [
            name,
            f"{r['time_s'] * 1e3:,.1f}",
            f"{r['time_s'] / base['time_s']:.2f}",
            _num(r["device_peak"] / GIB),
            _num(r["device_peak"] / model_bytes),
            _num(r["device_peak"] / base["device_peak"]),
        ]
        if on_gpu:
            row.append(_num(r["host_peak"] / GIB))
        rows.append(row)
    where = "GPU memory (torch.cuda.max_memory_allocated)" if on_gpu else "peak RSS"
    intro = (
        f"GPT-2-style layout (d {args.d_model}, {args.layers} layers, vocab {args.vocab}, "
        f"seq {args.seq_len}): "
        f"{len(layout.slots)} parameters, {layout.numel / 1e9:.3f} B elements of "
        f"{layout.dtype} ({model_bytes / GIB:.2f} GiB), alignment {layout.alignment}, "
        f"{world} ranks{' (gloo, one thread each)' if not on_gpu else ''}. Median of "
        f"{args.repeats} runs, slowest rank. Peak: {where} above the level "
        "before the parameters were built, so the parameters themselves count once; "
        "`peak / params` is that peak over their size (2.0 = originals + one full copy). "
        "All methods packed the same bytes (checked)."
    )
    if not on_gpu:
        intro += (
            " The ranks' device is the host here, so DEVICE and CPU make the same copy."
            " On gloo, all_gather_into_tensor itself stages the output through a temporary "
            "of the output's size (we measured it), which adds 1.0 to the "
            "DISTRIBUTED peak here; NCCL gathers in place."
        )
    table: str = markdown_table(header, rows)
    return intro + "\n\n" + table


def main() -> None:
    """Run every method in turn on every rank; rank 0 writes the report."""
    args = parse_args()
    use_cuda = torch.cuda.is_available() and not args.smoke
    device = init_ranks(args.nproc, cuda=use_cuda)
    _return_freed_host_memory()
    world = dist.get_world_size()
    dtype = DTYPES[args.dtype or ("fp32" if args.smoke else "bf16")]
    shapes = gpt_shapes(args.d_model, args.layers, args.vocab, args.seq_len)
    layout = FlatLayout.build(shapes, dtype, world, alignment=args.alignment)
    group = Group()

    def tier(t: FlattenTier) -> Callable[[list[torch.Tensor]], torch.Tensor]:
        return lambda ps: flatten_params(ps, layout, device=device, tier=t, group=group)[0]

    methods: dict[str, Callable[[list[torch.Tensor]], torch.Tensor]] = {
        "torch.cat": lambda ps: _torch_cat(ps, layout),
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
        body = report(results, layout, device, world, args)
        print(body, flush=True)
        if not args.no_write:
            title = "Flattening tiers" + ("" if use_cuda else " on the CPU host (gloo)")
            publish(args.section, title, body, smoke=args.smoke)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
