"""The markdown of benchmarks/offload: training rows, CPU AdamW rows, ratios, part times."""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks._common import markdown_table
from benchmarks.offload._bf16 import BF16, goals, host_table
from benchmarks.offload._plan import plan_lines
from benchmarks.offload._rounds import SKIPPED


def _cell(r: dict[str, Any], key: str, fmt: str) -> str:
    return format(r[key], fmt) if r.get("ok") else "-"


NAMES = {
    "train-zs-overlap": "zeroshard offload_optimizer, step_in_backward",
    "train-zs-ratio": "zeroshard offload_optimizer, offload_ratio {ratio:g}, step_in_backward",
    "train-zs-dpu": "zeroshard offload_optimizer, delay_param_update",
    "train-zs": "zeroshard offload_optimizer",
    "train-zs-clip": "zeroshard offload_optimizer, clip_grad_norm_",
    "train-ds": "DeepSpeed ZeRO-Offload",
}
# The zeroshard rows again with offload_compiled_step (part name + "-compiled"), and with
# bf16 masters (+ BF16), DeepSpeed's too.
ZS_ROWS = ("train-zs-overlap", "train-zs-ratio", "train-zs-dpu", "train-zs", "train-zs-clip")
NAMES.update({f"{k}-compiled": f"{NAMES[k]}, compiled_step" for k in ZS_ROWS})
NAMES.update({f"{k}{BF16}": f"{NAMES[k]}, bf16 masters" for k in ZS_ROWS})
NAMES.update({f"{k}-compiled{BF16}": f"{NAMES[k]}, compiled_step, bf16 masters" for k in ZS_ROWS})
NAMES[f"train-ds{BF16}"] = "DeepSpeed ZeRO-Offload, bf16 masters and optimizer states"
# zeroshard's offloaded step alone, as each kind of row runs it (what its lines add).
HOST_STEP_PARTS = (
    ("adam-zs-host", ""),
    ("adam-zs-host-compiled", ", compiled_step"),
    (f"adam-zs-host{BF16}", ", bf16 masters"),
    (f"adam-zs-host-compiled{BF16}", ", compiled_step, bf16 masters"),
)


def _kind(part: str) -> str:
    """Which offloaded step alone a part's row runs: the name ending of its `adam-zs-host`."""
    return ("-compiled" if "-compiled" in part else "") + (BF16 if part.endswith(BF16) else "")


def _name(part: str, args: argparse.Namespace) -> str:
    """A row's label, with the run's `--offload-ratio` where the row has one."""
    return NAMES[part].format(ratio=args.offload_ratio)


def _host_share(part: str, args: argparse.Namespace) -> float:
    """The share of the parameters whose optimizer step runs on the host (and whose
    gradient and master cross the bus) in `part`'s row."""
    return args.offload_ratio if part.startswith("train-zs-ratio") else 1.0


def _step(args: argparse.Namespace, r: dict[str, Any]) -> str:
    """The median step, with rounds each round's step in the order run, and the fastest
    and slowest step measured."""
    if not r.get("ok"):
        return "-"
    steps = f"steps {r['fastest_step_s']:.2f}-{r['slowest_step_s']:.2f}"
    if args.rounds == 1:
        return f"{r['step_s']:.2f} ({steps})"
    spread = " / ".join(f"{s:.2f}" for s in r["rounds_step_s"])
    return f"{r['step_s']:.2f} ({spread}; {steps})"


def _status(r: dict[str, Any]) -> str:
    if not r.get("ok"):
        return str(r["error"])
    skipped = r.get("skipped_rounds", 0)
    return (
        f"ok; {skipped} of {skipped + len(r['rounds_step_s'])} rounds {SKIPPED}"
        if skipped
        else "ok"
    )


_TRAIN_COLUMNS = [
    "engine",
    "params",
    "step s",
    "tokens/s",
    "GPU peak GiB",
    "host peak GiB",
    "init s",
    "",
]


def _train_rows(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> list[list[str]]:
    rows = []
    for p, r in results.items():
        if not p.startswith("train-"):
            continue
        name, _, layers = p.partition("@")
        label = _name(name, args) + (" + offload_params" if args.offload_params else "")
        label += f" (stage {args.stage})" + (f", {layers} blocks" if layers else "")
        rows.append(
            [
                label,
                f"{r['params'] / 1e9:.2f}B" if r.get("ok") else "-",
                _step(args, r),
                _cell(r, "tokens_per_s", ",.0f"),
                _cell(r, "gpu_peak_gib", ".1f"),
                _cell(r, "host_peak_gib", ".1f"),
                _cell(r, "init_s", ".0f"),
                _status(r),
            ]
        )
    return rows


def _resources(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> str:
    """The step against the GPU, the bus and the CPU alone (what overlap can reach); a row
    with an offload ratio against the bus's and the CPU's work for its share."""
    fb, tr, adam = (results.get(k, {}) for k in ("fwd-bwd", "transfer", "adam-torch-fused"))
    runs = {k: results.get(k, {}) for k in NAMES if not k.startswith("train-ds")}
    done = {k: r for k, r in runs.items() if r.get("ok")}
    if not (fb.get("ok") and tr.get("ok") and adam.get("ok") and done):
        return ""
    params = next(iter(done.values()))["params"]
    cpu = params / adam["params_per_s"]
    alone = [fb["step_s"], tr["step_s"], cpu]
    slowest = max(alone)

    def against(k: str, r: dict[str, Any]) -> str:
        share = _host_share(k, args)
        if share == 1.0:
            return f"{r['step_s'] / slowest:.2f} ({_name(k, args)})"
        own = max(fb["step_s"], share * tr["step_s"], share * cpu)
        return (
            f"{r['step_s'] / own:.2f} ({_name(k, args)}: against {own:.2f} s, the largest "
            f"of the three with the transfer and the CPU AdamW for its share {share:g})"
        )

    ratios = ", ".join(against(k, r) for k, r in done.items())
    return (
        f"\n\nEach resource alone, same run: GPU forward + backward {fb['step_s']:.2f} s (bf16, "
        f"no optimizer, no offload); transfer {tr['step_s']:.2f} s (every parameter down in bf16 "
        f"{tr['d2h_s']:.2f} s at {tr['d2h_gb_per_s']:.1f} GB/s, up in "
        f"{tr['h2d_dtype']} {tr['h2d_s']:.2f} s at "
        f"{tr['h2d_gb_per_s']:.1f} GB/s); CPU AdamW {cpu:.2f} s (torch fused over "
        f"{params / 1e9:.2f}B parameters at the rate measured over "
        f"{adam['params'] / 1e9:g}B{_rate_rounds(adam)}). Their sum is {sum(alone):.2f} s."
        f"\n\nstep / max of the three (goal <= 1.15): {ratios}."
        + _against_own_step(args, results, done, params)
    )


def _rate_rounds(adam: dict[str, Any]) -> str:
    """The CPU AdamW's rate in each round, where it ran in more than one."""
    rates = adam.get("rounds_params_per_s", [])
    if len(rates) < 2:
        return ""
    each = " / ".join(f"{r / 1e9:.2f}" for r in rates)
    return f": the median of {len(rates)} rounds' {each} G parameters/s, in the order run"


def _against_own_step(
    args: argparse.Namespace,
    results: dict[str, dict[str, Any]],
    done: dict[str, dict[str, Any]],
    params: int,
) -> str:
    """Each zeroshard row's step over zeroshard's own offloaded step alone (same build:
    compiled_step or not), scaled to the parameters the row steps on the host: how much
    of the step is not the CPU step."""
    lines = []
    for part, what in HOST_STEP_PARTS:
        host = results.get(part, {})
        rows = {k: r for k, r in done.items() if _kind(k) == _kind(part)}
        if not (host.get("ok") and rows):
            continue
        own = params / host["params_per_s"]
        ratios = ", ".join(
            f"{r['step_s'] / (own * _host_share(k, args)):.2f} ({_name(k, args)})"
            for k, r in rows.items()
        )
        lines.append(
            f"\n\nstep / zeroshard's offloaded step alone{what} ({own:.2f} s at "
            f"{params / 1e9:.2f}B parameters, at the rate `{part}` measured): {ratios}."
        )
    return "".join(lines)


# Bytes a parameter moves through host memory, counted as host-stream counts them (a
# write into lines not in cache reads them first): torch's fused AdamW reads and writes
# the fp32 master, exp_avg and exp_avg_sq (24) and reads an fp32 gradient (4); zeroshard's
# offloaded step reads a bf16 gradient (2) instead and writes nothing more (the device
# casts the masters); the bus's copies take a bf16 gradient down and the fp32 master up
# (2 + 4).
FUSED_ADAMW_BYTES = 28
OFFLOADED_STEP_BYTES = 26
BUS_BYTES = 6


def _host_memory(results: dict[str, dict[str, Any]]) -> str:
    """The host memory's streaming rate, and how long the CPU's AdamW and the bus's copies
    take at it: they share that memory."""
    stream, adam = results.get("host-stream", {}), results.get("adam-torch-fused", {})
    if not stream.get("ok"):
        return ""
    bw = stream["gb_per_s"] * 1e9
    trained = [r for k, r in results.items() if k.startswith("train-") and r.get("ok")]
    params = trained[0]["params"] if trained else stream["elements"]

    def at_rate(nbytes: int) -> str:
        return f"{nbytes * params / bw:.2f} s"

    line = (
        f"\n\nHost memory streams {bw / 1e9:.0f} GB/s (`host-stream`: c = a + b over "
        f"{stream['elements'] / 1e9:g}B fp32 elements, {stream['threads']} threads; 16 bytes "
        "an element: two reads, and a write into lines not in cache, which the core reads "
        f"first). At that rate, for {params / 1e9:.2f}B parameters: torch's fused AdamW "
        f"({FUSED_ADAMW_BYTES} bytes a parameter: fp32 master, exp_avg and exp_avg_sq read "
        f"and written, an fp32 gradient read) {at_rate(FUSED_ADAMW_BYTES)}"
    )
    if adam.get("ok"):
        moved = FUSED_ADAMW_BYTES * adam["params_per_s"] / 1e9
        line += f" (alone it moved {moved:.0f} GB/s)"
    return line + (
        f"; zeroshard's offloaded step ({OFFLOADED_STEP_BYTES} bytes: a bf16 gradient read "
        f"instead of the fp32 gradient) {at_rate(OFFLOADED_STEP_BYTES)}"
        f"; the bus's copies, a bf16 gradient down and the fp32 master up ({BUS_BYTES} "
        f"bytes), through the same memory, {at_rate(BUS_BYTES)} more."
    )


def _wall(r: dict[str, Any]) -> str:
    walls = r.get("rounds_wall_s", [])
    each = " (" + " / ".join(f"{w:.0f}" for w in walls) + ")" if len(walls) > 1 else ""
    return f"{r.get('wall_s', 0.0):.0f}s{each}"


def report(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> str:
    """The markdown body: training rows, the resources alone, CPU AdamW rows, part times."""
    recompute = "on" if args.activation_checkpointing else "off"
    body = (
        f"GPT `{args.preset}` width, {args.layers} blocks, seq {args.seq_len}, micro-batch "
        f"{args.micro_batch}, activation checkpointing {recompute}, "
        f"bf16 compute, AdamW; median of {args.steps} steps after "
        f"{args.warmup} warmup, the fastest and slowest of them after `steps`. One process "
        "per row"
        + (
            f" and round: {args.rounds} rounds of the training rows in alternating order (as "
            "listed in --parts, then reversed, ...); step s is the median of the rounds' "
            "medians, each round's in brackets in the order run, tokens/s from the median, "
            "peaks the largest of any round, init the median. A row that fails in a round is "
            "not run again and has no median. The CPU's AdamW alone runs every round too "
            "(its rate the median of the rounds'); the other parts run once, in the first "
            "round where --parts lists them."
            if args.rounds > 1
            else "."
        )
        + "\n\n"
    )
    if args.search_layers:
        body = body.replace(f"{args.layers} blocks", "blocks as below")
    rows = _train_rows(args, results)
    if rows:
        body += markdown_table(_TRAIN_COLUMNS, rows)
    else:  # no training part ran (the CPU's step alone, say): no model, no empty table
        body = ""
    if args.search_layers:
        fits = [r for r in results.values() if r.get("ok")]
        # A size skipped for lack of time is no failure: only a size that ran and failed
        # bounds the search from above.
        failed = [r for r in results.values() if not r.get("ok") and "skipped" not in r["error"]]
        if not fits:
            body += "\n\nLargest that trains: none of those tried."
        elif not failed:
            # No size failed: the limit lies above the search, which says nothing more.
            body += (
                f"\n\nLargest that trains: at least {fits[-1]['params'] / 1e9:.2f}B "
                "(every size tried trained; the limit lies above the search)."
            )
        else:
            body += f"\n\nLargest that trains: {fits[-1]['params'] / 1e9:.2f}B."
        body += plan_lines(results)
    ds = results.get("train-ds", {})
    for k in (k for k in NAMES if not k.startswith("train-ds") and "clip" not in k):
        zs = results.get(k, {})
        if zs.get("ok") and ds.get("ok"):
            ratio = zs["tokens_per_s"] / ds["tokens_per_s"]
            body += f"\n\n{_name(k, args)} / DeepSpeed tokens/s: {ratio:.2f}"
    body += host_table(results, lambda part: _name(part, args))
    body += goals(results)
    body += _resources(args, results)
    body += _host_memory(results)
    adam_names = {
        "adam-torch-fused": "torch AdamW fused=True (CPU)",
        "adam-torch-foreach": "torch AdamW foreach=True (CPU)",
        "adam-ds": "DeepSpeedCPUAdam",
        "adam-zs-host": "zeroshard offloaded step alone (bf16 grads in, fp32 masters up)",
        "adam-zs-host-compiled": "the same with offload_compiled_step",
        f"adam-zs-host{BF16}": "the same with bf16 masters and moments (bf16 shards out)",
        f"adam-zs-host-compiled{BF16}": "the same with bf16 masters and offload_compiled_step",
    }
    adam_rows = []
    for p, label in adam_names.items():
        if p in results:
            r = results[p]
            rate = f"{r['params_per_s'] / 1e6:,.0f}M" if r.get("ok") else "-"
            threads = r.get("threads", "-") if r.get("ok") else "-"
            n = f"{r['params'] / 1e9:g}B" if r.get("ok") else "-"
            adam_rows.append(
                [
                    label,
                    n,
                    rate,
                    _cell(r, "step_s", ".3f"),
                    threads,
                    "ok" if r.get("ok") else r["error"],
                ]
            )
    if adam_rows:
        body += (
            f"\n\nCPU optimizer step over fp32 parameters in tensors of {args.chunk:,} "
            f"elements (foreach on a tenth as many, to bound its time), median of "
            f"{args.adam_steps} steps:\n\n"
        )
        body += markdown_table(
            ["optimizer", "params", "params/s", "step s", "threads", ""], adam_rows
        )
    fused, dsa = results.get("adam-torch-fused", {}), results.get("adam-ds", {})
    if fused.get("ok") and dsa.get("ok"):
        ratio = fused["params_per_s"] / dsa["params_per_s"]
        body += f"\n\ntorch fused / DeepSpeedCPUAdam params/s: {ratio:.2f}"
    for part, what in HOST_STEP_PARTS:
        host = results.get(part, {})
        if fused.get("ok") and host.get("ok"):
            ratio = fused["params_per_s"] / host["params_per_s"]
            body += (
                f"\n\nzeroshard's offloaded step alone{what} / torch fused AdamW alone, "
                f"time per parameter: {ratio:.2f}"
            )
    build = results.get("ds-build", {})
    if build:
        done = f"{build['build_s']:.0f} s" if build.get("ok") else build["error"]
        body += f"\n\nDeepSpeedCPUAdam extension build (untimed, outside the budget): {done}."
    times = ", ".join(f"{p} {_wall(r)}" for p, r in results.items())
    body += f"\n\nWall time per part: {times}."
    return body.lstrip("\n")  # without training rows it began at a paragraph break
