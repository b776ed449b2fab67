"""The two sections' markdown: the step-time overhead and the recovery time."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks._common import markdown_table
from benchmarks.snapshots._overhead import SETTLE_S
from benchmarks.snapshots._profile import COLUMNS, ms


def overhead(rows: Sequence[Mapping[str, Any]], shape: str) -> str:
    """The overhead table: each mode's mean step against no saving."""
    base = next((r["step_ms"] for r in rows if r["mode"] == "none"), float("nan"))

    def vs_none(step_ms: float) -> str:
        return f"{100 * (step_ms / base - 1):+.1f}%"

    table = []
    for r in sorted(rows, key=lambda r: (r["mode"] != "none", r["every"], r["mode"])):
        none = r["mode"] == "none"
        # The mean step with the block's drain: the blocks after the first, as step ms.
        later = list(zip(r["blocks_ms"], r["drains_ms"], strict=True))[1:]
        drained = statistics.median(b + d / r["steps"] for b, d in later) if later else r["step_ms"]
        table.append(
            (
                r["mode"],
                "-" if none else r["every"],
                f"{r['step_ms']:.1f}",
                "-" if none else vs_none(r["step_ms"]),
                "-" if none else f"{r['call_ms']:.1f}",
                " ".join(f"{b:.1f}" for b in r["blocks_ms"]),
                " ".join(f"{d:.0f}" for d in r["drains_ms"]),
                "-" if none else f"{drained:.1f} ({vs_none(drained)})",
            )
        )
    size = rows[0]["snapshot_bytes"] / 2**20
    journal = ""
    for r in rows:
        if r["mode"] == "journal" and r["journal_ms"] is not None:
            full, after, entry = r["journal_ms"]
            journal = (
                f"\n\n`journal` (every N steps: K, a full snapshot every K steps and a "
                f"journal entry of {r['entry_bytes'] / 2**20:,.0f} MiB, the gradient shards, "
                f"at each step between; its block's mean step is the amortized one at K): "
                f"`take` {full:.1f} ms at a full snapshot, {after:.1f} ms at the entry after "
                "it, "
                + (f"{entry:.1f} ms" if entry == entry else "-")
                + " at the other entries (each waits for the entry before's device copy and "
                "for its slot: [Note: snapshot lifecycle] in recovery/_snapshots.py)."
            )
    return (
        f"{shape}. Each rank's snapshot: {size:,.0f} MiB (masters and optimizer state). "
        "Mean step over a block of "
        f"{rows[0]['steps']} steps, from its first step to its last step's end on the training "
        "stream (a wait for an earlier save, a slot or a copy, is in it; the last save's "
        "copy on its side stream and its background work are not: in a run they overlap "
        "the next steps, as the earlier saves' did), the median of "
        "the blocks after the first (a process's first takes map and pin their slots: the "
        "first block is listed first in `blocks ms`); the save call alone (`take` or DCP's "
        "`async_save`, which first waits for the save before it), its mean over every step "
        "of those blocks. `drain ms`: the wait for the block's last save after it, each "
        "block's; `with drain`: the mean step had each block waited for it (the median of "
        "the later blocks), the bound a run of one block would see. Modes alternate "
        "their order by round; before each block the process collects its garbage and, on a "
        f"GPU, idles {SETTLE_S:g} s, so that what the block before left running is not "
        "timed in it.\n\n"
        + markdown_table(
            [
                "mode",
                "every N steps",
                "step ms",
                "vs none",
                "save call ms",
                "blocks ms",
                "drain ms",
                "with drain ms",
            ],
            table,
        )
        + journal
        + _profile_table(rows)
    )


def _profile_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Where the snapshots' time went: each row's first block and the median of the
    others, by kind of take."""
    table = []
    for r in rows:
        blocks = r.get("profile") or ()
        for which, chosen in (("first", blocks[:1]), ("later", blocks[1:])):
            for kind in ("full", "entry"):
                per = [b[kind] for b in chosen if kind in b]
                if not per:
                    continue
                med = {k: statistics.median(b[k] for b in per) for k, _ in COLUMNS}
                table.append(
                    (
                        f"{r['mode']} every {r['every']}",
                        which,
                        kind,
                        sum(b["n"] for b in per),
                        f"{per[0]['mib']:,.0f}",
                        *(ms(med[k]) for k, _ in COLUMNS),
                        f"{statistics.median(b['stall_ms_per_step'] for b in chosen):.1f}",
                        f"{statistics.median(b['gib_per_step'] for b in chosen):.2f}",
                    )
                )
    if not table:
        return ""
    return (
        "\n\nWhere the snapshots' time goes (`benchmarks/snapshots/_profile.py`; the "
        "medians of a block's takes of each kind, then of the blocks): `take` is host ms in "
        "it, of which `slot wait` waiting for the snapshot that frees its slot and `copy "
        "wait` for the entry before's device copy; `copy (device)` runs from the end of "
        "the step snapshotted to the copy's end on the device (none on the CPU: host "
        "tensors are copied inside `take`); `sealed`, `linked` and `complete` are ms from "
        "the take's start to the checksum's end, the link and the replicas agreed; "
        "`stall` is ms per step the optimizer step's stream waited for a copy; GiB per "
        "step copied.\n\n"
        + markdown_table(
            [
                "row",
                "blocks",
                "take kind",
                "takes",
                "MiB",
                *(label for _, label in COLUMNS),
                "stall ms/step",
                "GiB/step",
            ],
            table,
        )
    )


def recovery(
    fresh: Sequence[Mapping[str, float]], rec: Sequence[Mapping[str, float]], shape: str
) -> str:
    """The recovery table: the medians of the rounds, the fresh start beside it."""

    def med(runs: Sequence[Mapping[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    parts = ["rendezvous", "worker_start", "setup", "fetch", "load", "first_step", "total"]
    rows = [
        ("fresh start (launch to first step)", *(f"{med(fresh, k):.2f}" for k in parts)),
        ("node lost, replaced (kill to first new step)", *(f"{med(rec, k):.2f}" for k in parts)),
    ]
    return (
        f"{shape}. Seconds, the median of {len(rec)} rounds (each a fresh start and a "
        f"recovery). Node a's ranks read their own memory; the new node's ranks fetched "
        f"{med(rec, 'fetched_mib'):.1f} MiB each from node a's replicas. `rendezvous` runs "
        "from the launch (or the kill) to the last worker's start, `worker_start` to the "
        "last rank's process group up, `setup` to `Snapshots.resume`; fetch and load are "
        "the slowest rank's.\n\n" + markdown_table(["run", *parts], rows)
    )
