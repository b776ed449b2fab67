"""The summary's tables, each row read from one run section (which its last column links).

A ratio is the quotient of two figures of the same section: an engine's tokens/s over its
floor's or a peer's (above 1: faster), a step over the CPU's AdamW alone. Nothing is
measured or typed in here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from benchmarks.summary._sections import Section, number


@dataclass(frozen=True)
class Step:
    """A train_step row: `engine` of `section`, divided by its `floor` and `peers`."""

    section: str
    engine: str
    floor: str | None = None
    peers: tuple[str, ...] = ()
    model: str = ""


def _link(s: Section) -> str:
    return f"[{s.name}](#{s.anchor})"


def _where(used: Sequence[Section]) -> str:
    """'1 x NVIDIA H200, 2026-11-28 and 2026-11-29': the devices and dates of the rows."""
    devices = sorted({s.measured[1] for s in used})
    dates = sorted({s.measured[0] for s in used})
    return f"{' and '.join(devices)}, {' and '.join(dates)}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(r) + " |" for r in rows)])


def _speed(table: Mapping[str, Mapping[str, str]], engine: str, other: str) -> str:
    """`engine`'s tokens/s over `other`'s, both of one section's table, naming `other`."""
    speed = number(table[engine]["tokens/s/GPU"]) / number(table[other]["tokens/s/GPU"])
    return f"{speed:.3f} `{other}`"


def step_table(title: str, note: str, rows: Sequence[Step], doc: Mapping[str, Section]) -> str:
    """Engines' tokens/s/GPU, MFU and peak memory, with their speed over the floor and
    the peers named in each row."""
    used = [doc[n] for n in dict.fromkeys(r.section for r in rows)]
    tables = {s.name: {row["engine"]: row for row in s.table("engine")} for s in used}
    models = any(r.model for r in rows)
    out = []
    for r in rows:
        table = tables[r.section]
        row = table[r.engine]
        cells = [
            f"`{r.engine}`",
            row["tokens/s/GPU"],
            row["MFU %"],
            row["peak GiB"],
            _speed(table, r.engine, r.floor) if r.floor else "-",
            ", ".join(_speed(table, r.engine, p) for p in r.peers) or "-",
            _link(doc[r.section]),
        ]
        out.append([r.model, *cells] if models else cells)
    header = ["engine", "tokens/s/GPU", "MFU %", "peak GiB", "speed / floor", "speed / peers"]
    header = [*(["model"] if models else []), *header, "run"]
    return f"### {title}\n\n{_where(used)}. {note}\n\n{_table(header, out)}"


def scaling_table(title: str, note: str, doc: Mapping[str, Section], preset: str) -> str:
    """tokens/s/GPU (its efficiency against the floor) and peak GiB at each world size."""
    s = doc["scaling"]
    built = re.search(r"^Built (\S+) ", s.body, re.M)
    device = re.search(r" on (NVIDIA [\w ]+?) \(", s.body)
    if built is None or device is None:
        raise ValueError("the scaling section has no 'Built DATE' line or NVIDIA device")
    after = f"### `{preset}`"
    speed = {r["engine"]: r for r in s.table("engine", after=after)}
    memory = {r["engine"]: r for r in s.table("engine", after=after, has="bound")}
    sizes = [c for c in next(iter(memory.values())) if c != "engine"]
    header = ["engine", *(c.split(":")[0] for c in sizes), "run"]
    rows = []
    for engine, mem in memory.items():
        cells = []
        for size in sizes:
            peak = mem[size].split(" / ")[0]
            tps = speed[engine][size.split(":")[0]]
            cells.append(f"{tps}, {peak} GiB" if peak != "-" else "-")
        rows.append([f"`{engine}`", *cells, _link(s)])
    where = f"{device.group(1)}s, {built.group(1)}"
    return f"### {title}\n\n{where}. {note}\n\n{_table(header, rows)}"


@dataclass(frozen=True)
class Offload:
    """An offload row (`engine` of `section`), over DeepSpeed's tokens/s or, with
    `adamw`, the step over the section's CPU fused AdamW alone on as many parameters."""

    section: str
    engine: str
    deepspeed: str | None = None
    adamw: bool = False


def offload_table(
    title: str, note: str, rows: Sequence[Offload], doc: Mapping[str, Section]
) -> str:
    """Offloaded training rows: tokens/s, GPU and host peaks, and their ratio."""
    out = []
    for r in rows:
        s = doc[r.section]
        table = {row["engine"]: row for row in s.table("engine")}
        row = table[r.engine]
        if r.deepspeed is not None:
            ratio = (
                f"{number(row['tokens/s']) / number(table[r.deepspeed]['tokens/s']):.2f}x DeepSpeed"
            )
        elif r.adamw:
            adam = next(a for a in s.table("optimizer") if "AdamW" in a["optimizer"])
            alone = number(row["params"]) / number(adam["params/s"])
            ratio = f"{number(row['step s']) / alone:.2f}x AdamW alone"
        else:
            ratio = "-"
        cells = [row["engine"], row["params"], row["tokens/s"], row["GPU peak GiB"]]
        out.append([*cells, row["host peak GiB"], ratio, _link(s)])
    header = ["engine", "params", "tokens/s", "GPU peak GiB", "host peak GiB", "ratio", "run"]
    used = [doc[n] for n in dict.fromkeys(r.section for r in rows)]
    return f"### {title}\n\n{_where(used)}. {note}\n\n{_table(header, out)}"


def consolidation_table(title: str, note: str, doc: Mapping[str, Section]) -> str:
    """Consolidation time, memory and speed-up against each framework's own tool."""
    out = []
    used = [doc["consolidate"], doc["consolidate_dcp"]]
    for s, what in zip(used, ("DeepSpeed ZeRO-3", "FSDP2 DCP"), strict=True):
        for row in s.table("input"):
            speedup = next(v for k, v in row.items() if k.startswith("speed-up"))
            cells = [what, row["input"], row["tool"], row["median s (3 runs)"]]
            out.append([*cells, row["peak RSS GiB"], speedup, row["x floor"], _link(s)])
    header = ["checkpoint", "input", "tool", "s", "peak RSS GiB", "speed-up", "x disk floor"]
    return f"### {title}\n\n{_where(used)}. {note}\n\n{_table([*header, 'run'], out)}"
