"""Where the device time of profiled steps goes, kernel by kernel, beside each other.

    python -m benchmarks.train_step.kernels bench-out/SECTION_floorc.trace.json \
        bench-out/SECTION_floorc8.trace.json [--top 20]

reads the Chrome traces that `--profile` writes (two steps each) and prints one markdown
table: the kernels (by name) taking the most time per step in any trace, and each trace's
ms per step in them; then the total kernel time and the optimizer's per step. Names are
cut to their first 70 characters, so inductor's numbered fusions of one pattern count as
one row. `--by-kind` sums them by kind instead (`kind`): where fp8's matmul savings go.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from benchmarks._common import markdown_table
from benchmarks.train_step._trace import read_trace

_NAME = 70


def kind(name: str) -> str:
    """What a kernel does, from its name: cuBLAS's matmuls (`nvjet_sm90_q...`: fp8
    inputs), attention, torch's foreach kernels, inductor's fusions that take an amax or
    scale and saturate (torchao's dynamic fp8 casts: abs, max, clamp), its other fusions."""
    if name.startswith("nvjet") or re.search("gemm|cutlass", name, re.IGNORECASE):
        return "matmul, fp8" if name.startswith("nvjet_sm90_q") else "matmul, bf16"
    if re.search("sdpa|flash|fmha", name):
        return "attention"
    if "multi_tensor_apply" in name:
        return "foreach (outside the optimizer step)"
    if name.startswith("triton") and re.search("abs|amax|clamp", name):
        return "inductor, amax / scale / cast"
    if name.startswith("triton"):
        return "inductor, other"
    return "other"


def per_step(
    path: Path, steps: int, by_kind: bool = False
) -> tuple[dict[str, float], float, float]:
    """Kernel ms per step by (cut) name or by `kind` (the optimizer step's kernels apart),
    all kernels' and the optimizer's ms per step."""
    kernels, optimizer = read_trace(path)
    by_name: dict[str, float] = {}
    for k in kernels:
        if by_kind:
            name = "optimizer step" if k.correlation in optimizer else kind(k.name)
        else:
            name = k.name[:_NAME]
        by_name[name] = by_name.get(name, 0.0) + k.dur / 1000 / steps
    total = sum(k.dur for k in kernels) / 1000 / steps
    opt = sum(k.dur for k in kernels if k.correlation in optimizer) / 1000 / steps
    return by_name, total, opt


def main() -> None:
    """Print the table of the traces named on the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=20, help="kernel names shown")
    parser.add_argument("--steps", type=int, default=2, help="steps in each trace")
    parser.add_argument("--by-kind", action="store_true", help="sum the kernels by kind")
    a = parser.parse_args()
    runs = [per_step(p, a.steps, a.by_kind) for p in a.traces]
    names = sorted(
        {n for by_name, _, _ in runs for n in by_name},
        key=lambda n: -max(by_name.get(n, 0.0) for by_name, _, _ in runs),
    )[: a.top]
    heads = [p.name.removesuffix(".trace.json") for p in a.traces]
    rows = [[f"`{n}`", *(f"{by_name.get(n, 0.0):.2f}" for by_name, _, _ in runs)] for n in names]
    rows.append(["all kernels (summed)", *(f"{total:.2f}" for _, total, _ in runs)])
    rows.append(["of which the optimizer step", *(f"{opt:.2f}" for _, _, opt in runs)])
    print(markdown_table(["kernel (ms per step)", *heads], rows))


if __name__ == "__main__":
    main()
