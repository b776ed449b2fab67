"""The markdown of benchmarks/train_step: its table, ratios, goals and profile tables.

Kept apart from the measuring so that each file has one concern: `Result` rows come in,
markdown goes out (the figures are `_plots.py`'s). Ratios compare zeroshard only with
peers measured in the same run.
"""

from __future__ import annotations

import argparse
import importlib.metadata

from benchmarks._common import markdown_table
from benchmarks._common._models import BenchModel
from benchmarks.train_step._compile import CompileTime
from benchmarks.train_step._engines import ENGINES
from benchmarks.train_step._float8_goals import float8_goals
from benchmarks.train_step._goals import compile_table, muon_goals, one_gpu_goals
from benchmarks.train_step._offload_goals import offload_goals
from benchmarks.train_step._result import Result
from benchmarks.train_step._settings import Settings


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def report(
    results: list[Result],
    bm: BenchModel,
    args: argparse.Namespace,
    settings: Settings,
    ranks: str,
    world: int,
    compile_times: list[CompileTime],
) -> str:
    """The markdown body: settings, the table, ratios, goals, compile times and the profile
    summary."""
    tokens = args.micro_batch * bm.seq_len
    on_gpu = settings.device.type == "cuda"
    by = {r.engine: r for r in results if r.step_ms is not None}
    floor = by.get("floor")
    rows: list[list[object]] = []
    for r in results:
        if r.step_ms is None:
            status = f"FAILED: {r.error}" if r.error is not None else f"skipped: {r.skipped}"
            rows.append([f"`{r.engine}`", r.what, *["-"] * 7, status])
            continue
        assert r.step_ms is not None
        tps = r.tokens_per_s_per_gpu(tokens)
        assert tps is not None
        mfu = 100 * bm.flops_per_token * tps / (args.peak_tflops * 1e12) if on_gpu else None
        vs = _fmt(r.step_ms / floor.step_ms, ".3f") if floor and floor.step_ms else "-"
        spread = " / ".join(f"{t:.1f}" for t in r.rounds_ms)
        rows.append(
            [
                f"`{r.engine}`",
                r.what,
                _fmt(r.init_s, ".2f"),
                _fmt(r.step_ms, ".1f") + (f" ({spread})" if len(r.rounds_ms) > 1 else ""),
                _fmt(tps, ",.0f"),
                _fmt(mfu, ".1f"),
                _fmt(r.peak_gib, ".1f"),
                _fmt(r.states_gib, ".1f"),
                vs,
                "ok",
            ]
        )
    ac = (
        " Activation checkpointing: every block recomputed in backward (non-reentrant "
        "torch.utils.checkpoint), for every engine."
        if args.activation_checkpointing
        else ""
    )
    zs_extra = (
        "" if args.zs_config.strip() in ("", "{}") else f" zeroshard extras: `{args.zs_config}`."
    )
    # zeroshard's commit is in the section's first line (`environment`).
    versions = (
        f"- versions: transformers {importlib.metadata.version('transformers')}.\n"
        if bm.name.startswith("hf-")
        else ""
    )
    optimizers = (
        "torch.optim.Muon on the hidden matrices (lr 0.02, match_rms_adamw) and torch AdamW "
        "(fused on CUDA) on the rest; DeepSpeed its own Muon"
        if settings.optimizer == "muon"
        else "torch AdamW (fused on CUDA)"
    )
    head = (
        f"`{bm.name}` `{bm.preset}`: {bm.parameters / 1e6:,.1f} M parameters ({bm.shape}); "
        f"micro-batch {args.micro_batch} "
        f"per rank, {ranks}, compute "
        f"{str(settings.dtype).removeprefix('torch.')} (zeroshard's master weights and "
        f"optimizer state {settings.zs_config.get('master_dtype', 'fp32')}), {optimizers}, "
        f"clip {args.clip or 'off'}, random tokens.\n\n{versions}"
        f"- step: median of {args.steps} steps after {args.warmup} warm-up, each "
        "synchronized, on the slowest rank; the floors (`floor`, `floor32`, `floorc`, "
        "`floor8`, `floorc8`) run alone on rank 0."
        + (
            f" fp8 engines: torchao's `{settings.fp8}` recipe on every block's linears."
            if any(ENGINES[r.engine].fp8 for r in results)
            else ""
        )
        + (
            f" {args.rounds} rounds, engines in alternating order (as listed, then "
            "reversed, ...), each engine built afresh every round: the median of the "
            "rounds' medians, each round's in brackets in the order run; peak and states "
            "the largest of any round; the profile from the last round."
            if args.rounds > 1
            else ""
        )
        + "\n"
        f"- MFU: {bm.flops_per_token / 1e9:.2f} GFLOP/token (6N + 12 L d T, PaLM's "
        f"convention, see examples/{bm.name.removeprefix('hf-')}.py) x tokens/s/GPU / "
        f"{args.peak_tflops:g} TFLOP/s.\n"
        "- init: the wrapping call alone (DDP(), fully_shard, zs.initialize, "
        "deepspeed.initialize) on a model already built on the device, after an untimed "
        "first set-up of the same engine on a tiny model, so one-time costs (imports, "
        "DeepSpeed's communication set-up) are not charged to whichever engine runs first.\n"
        "- peak: torch.cuda.max_memory_allocated from wrapping to the last step, largest "
        "rank; every engine starts from an emptied cache. states: still allocated after the "
        "last step (parameters, optimizer state, persistent gradient shards) above the level "
        "before the model was built, largest rank." + ac + zs_extra
    )
    header = [
        "engine",
        "what",
        "init s",
        "step ms",
        "tokens/s/GPU",
        "MFU %",
        "peak GiB",
        "states GiB",
        "step / floor",
        "status",
    ]
    body = [head, "", markdown_table(header, rows), "", ratios(by)]
    # Every engine run, failed ones too: the goals tell a failed engine from one not asked for.
    every = {r.engine: r for r in results}
    if settings.optimizer == "muon":
        goals = muon_goals(every) if world == 1 else []
    else:
        goals = one_gpu_goals(every, compile_times) if world == 1 else []
    if goals:
        body += ["", *goals]
    fp8 = float8_goals(by)
    if fp8:
        body += ["", *fp8]
    offload = offload_goals(every)
    if offload:
        body += ["", *offload]
    if compile_times:
        body += ["", *compile_table(compile_times)]
    leaks = [f"`{r.engine}` {r.left_gib:.2f} GiB" for r in results if r.left_gib > 0.25]
    if leaks:
        body += [
            "",
            "Still allocated after an engine was freed (inflates the peaks after it): "
            + ", ".join(leaks)
            + ".",
        ]
    traced = [r for r in results if r.trace is not None]
    if traced:
        body += ["", *profile_tables(traced, by)]
    return "\n".join(body)


def profile_tables(traced: list[Result], by: dict[str, Result]) -> list[str]:
    """The step split per engine, and each engine's gap to its floor split into (a) exposed
    communication and (b) compute slowed by overlapping collectives (`_trace.py`)."""
    split: list[list[object]] = []
    gaps: list[list[object]] = []
    for r in traced:
        t = r.trace
        assert t is not None
        split.append(
            [
                f"`{r.engine}`",
                f"{t.window_ms:.1f}",
                f"{t.compute_only_ms:.1f}",
                f"{t.optimizer_ms:.1f}",
                f"{t.comm_ms:.1f}",
                f"{t.exposed_comm_ms:.1f}",
                f"{t.overlapped_compute_ms:.1f}",
                f"{t.overlap_slowdown_ms:.1f}",
                f"{t.idle_ms:.1f}",
            ]
        )
        floor = by.get(ENGINES[r.engine].floor)
        if ENGINES[r.engine].rank0_only or floor is None or not floor.step_ms:
            continue
        assert r.step_ms is not None
        gap = r.step_ms - floor.step_ms
        rest = gap - t.exposed_comm_ms - t.overlap_slowdown_ms
        gaps.append(
            [
                f"`{r.engine}`",
                f"`{floor.engine}`",
                f"{gap:.1f}",
                f"{t.exposed_comm_ms:.1f}",
                f"{t.overlap_slowdown_ms:.1f}",
                f"{rest:.1f}",
            ]
        )
    out = [
        "Profile (rank 0, ms per step over 2 profiled steps; compute excludes the optimizer "
        "step's kernels; exposed = NCCL kernel time with no compute kernel running; "
        "overlapped = compute kernel time with NCCL running; slowdown = how much longer the "
        "overlapped compute kernels ran than the same kernels in the floor's trace; idle = "
        "no kernel at all):",
        "",
        markdown_table(
            [
                "engine",
                "GPU window",
                "compute",
                "optimizer",
                "NCCL",
                "exposed NCCL",
                "overlapped compute",
                "slowdown",
                "idle",
            ],
            split,
        ),
    ]
    if gaps:
        out += [
            "",
            "Gap to the floor (ms per step: median step time minus the floor's), split into "
            "(a) exposed communication and (b) compute kernels slowed by overlapping "
            "collectives; the rest is everything else (casts, copies, host overhead, idle):",
            "",
            markdown_table(
                ["engine", "floor", "gap", "(a) exposed comm", "(b) overlap slowdown", "rest"],
                gaps,
            ),
        ]
    return out


def ratios(by: dict[str, Result]) -> str:
    """zeroshard against its peers measured in this run, and the issue's goals for stage 2."""
    lines = []
    peers = {1: ("ddp", "ds1"), 2: ("fsdp2-zero2", "ds2"), 3: ("fsdp2", "ds3")}
    for k, (fsdp, ds) in peers.items():
        zs = by.get(f"zs{k}")
        if zs is None or zs.step_ms is None:
            continue
        parts = []
        for peer in ("floor32", "floor", fsdp, ds):
            p = by.get(peer)
            if p is not None and p.step_ms:
                parts.append(f"{p.step_ms / zs.step_ms:.3f}x the speed of `{peer}`")
        d = by.get(ds)
        if d is not None and d.peak_gib and zs.peak_gib:
            parts.append(f"{zs.peak_gib / d.peak_gib:.2f}x `{ds}`'s peak memory")
        if d is not None and d.init_s and zs.init_s:
            parts.append(f"init {d.init_s / zs.init_s:.1f}x faster than `{ds}`")
        if parts:
            lines.append(f"- `zs{k}`: " + ", ".join(parts) + ".")
    zc = by.get("zs3c")
    if zc is not None and zc.step_ms:
        parts = [
            f"{p.step_ms / zc.step_ms:.3f}x the speed of `{name}`"
            for name in ("zs3", "fsdp2c", "fsdp2", "floorc", "floor")
            if (p := by.get(name)) is not None and p.step_ms
        ]
        eager = by.get("zs3")
        if eager is not None and eager.peak_gib and zc.peak_gib:
            parts.append(f"{zc.peak_gib / eager.peak_gib:.2f}x `zs3`'s peak memory")
        lines.append("- `zs3c`: " + ", ".join(parts) + ".")
    goals = _goals(by)
    return "\n".join(["Ratios (> 1x: zeroshard is faster):", "", *lines, *goals]) if lines else ""


def _goals(by: dict[str, Result]) -> list[str]:
    zs, floor, ds = by.get("zs2"), by.get("floor"), by.get("ds2")
    if zs is None or zs.step_ms is None:
        return []
    out = ["", "Goals for stage 2 (issue 3):", ""]
    if floor and floor.step_ms:
        over = zs.step_ms / floor.step_ms - 1
        out.append(
            f"- within 4% of the no-communication step: {over:+.1%} "
            f"({'met' if over <= 0.04 else 'NOT met'})"
        )
    if ds and ds.step_ms:
        sp = ds.step_ms / zs.step_ms
        out.append(
            f"- >= 1.11x DeepSpeed stage 2: {sp:.3f}x ({'met' if sp >= 1.11 else 'NOT met'})"
        )
    if ds and ds.peak_gib and zs.peak_gib:
        ok = zs.peak_gib <= ds.peak_gib
        out.append(
            f"- peak <= DeepSpeed stage 2's: {zs.peak_gib:.1f} vs {ds.peak_gib:.1f} GiB "
            f"({'met' if ok else 'NOT met'})"
        )
    if ds and ds.init_s and zs.init_s:
        sp = ds.init_s / zs.init_s
        out.append(
            f"- init >= 3x faster than DeepSpeed stage 2: {sp:.1f}x "
            f"({'met' if sp >= 3 else 'NOT met'})"
        )
    return out
