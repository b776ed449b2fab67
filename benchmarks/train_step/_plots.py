"""The figures of benchmarks/train_step: step time and peak memory per engine, and the
split of each profiled engine's step."""

from __future__ import annotations

from pathlib import Path

from benchmarks._common import pyplot
from benchmarks.train_step._result import Result


def plot_split(results: list[Result], path: Path, title: str) -> bool:
    """Stacked bars per profiled engine: compute, (b) compute slowed by overlapping
    collectives, optimizer, (a) exposed communication and the rest of the median step time;
    False if nothing was profiled or matplotlib is missing."""
    traced = [r for r in results if r.trace is not None and r.step_ms]
    plt = pyplot()
    if plt is None or not traced:
        return False
    names = [r.engine for r in traced]
    parts: dict[str, list[float]] = {
        "compute": [],
        "(b) compute slowed by overlapping collectives": [],
        "optimizer": [],
        "(a) exposed communication": [],
        "other (idle, host)": [],
    }
    for r in traced:
        t = r.trace
        assert t is not None and r.step_ms is not None
        slowed = min(t.overlap_slowdown_ms, t.compute_only_ms)
        parts["compute"].append(t.compute_only_ms - slowed)
        parts["(b) compute slowed by overlapping collectives"].append(slowed)
        parts["optimizer"].append(t.optimizer_ms)
        parts["(a) exposed communication"].append(t.exposed_comm_ms)
        busy = t.compute_ms + t.exposed_comm_ms
        parts["other (idle, host)"].append(max(r.step_ms - busy, 0.0))
    colors = ["tab:green", "tab:olive", "tab:purple", "tab:red", "tab:gray"]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(traced) + 2.4))
    left = [0.0] * len(traced)
    for (label, values), color in zip(parts.items(), colors, strict=True):
        ax.barh(names, values, left=left, label=label, color=color)
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)
    ax.set_xlabel("ms per step (median step time, split by the profile of 2 steps, rank 0)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3, fontsize=8)
    ax.set_title(f"Step time split per engine ({title})", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot(results: list[Result], path: Path, title: str) -> bool:
    """Bar charts of step time and peak memory per engine; False if matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    ok = [r for r in results if r.error is None and r.step_ms is not None]
    if not ok:
        return False
    names = [r.engine for r in ok]
    family = {"zs": "tab:green", "ds": "tab:orange", "fl": "tab:gray"}
    colors = [family.get(n[:2], "tab:blue") for n in names]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 0.45 * len(ok) + 1.6))
    bars = a.barh(names, [r.step_ms or 0 for r in ok], color=colors)
    a.bar_label(bars, fmt="%.1f", padding=2, fontsize=8)
    floor = next((r.step_ms for r in ok if r.engine == "floor"), None)
    if floor:
        a.axvline(floor, color="tab:gray", linestyle="--", linewidth=1)
    a.set_xlabel("median step time (ms, lower is better; dashed: no-communication floor)")
    peaks = [r.peak_gib or 0 for r in ok]
    bars = b.barh(names, peaks, color=colors)
    if any(peaks):
        b.bar_label(bars, fmt="%.1f", padding=2, fontsize=8)
    else:
        b.text(0.5, 0.5, "not measured on CPU", ha="center", transform=b.transAxes)
    b.set_xlabel("peak memory (GiB, lower is better)")
    for ax in (a, b):
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
        ax.margins(x=0.15)
    fig.suptitle(f"Training step per engine, {title} (benchmarks/train_step)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
