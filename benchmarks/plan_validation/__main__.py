"""Validate `zeroshard.engine.estimate` against the committed GPU runs; project to 1,024 GPUs.

Reads benchmarks/results/scale_*.json and tp_*.json (and nccl_raw_2gpu.json, the raw
NCCL curves, for the NVLink fit) and rewrites the generated sections of docs/scaling.md.
Runs on a CPU (the models are on the meta device). Rerun it after new GPU runs land in
benchmarks/results/:

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python -m benchmarks.plan_validation
"""

from __future__ import annotations

from benchmarks._common import replace_section
from benchmarks.plan_validation._sections import (
    SCALING_DOC,
    nvlink_fit,
    offload_validation,
    projections,
    recommendation,
    tp_validation,
    validation,
)


def main() -> None:
    """Rewrite the generated sections of docs/scaling.md."""
    link = nvlink_fit()
    replace_section(
        SCALING_DOC,
        "fit",
        f"Fitted NVLink: {link.gbps:.1f} GB/s bus bandwidth, {link.latency_us:.1f} us "
        "per ring step (fitted to the raw NCCL all-gather / reduce-scatter curves of "
        "benchmarks/results/nccl_raw_2gpu.json, 2 x NVIDIA H200, 2026-11-22).",
    )
    replace_section(SCALING_DOC, "validation", validation() + "\n\n" + offload_validation())
    replace_section(SCALING_DOC, "tp-validation", tp_validation())
    replace_section(SCALING_DOC, "projection", projections())
    replace_section(SCALING_DOC, "recommendation", recommendation())


if __name__ == "__main__":
    main()
