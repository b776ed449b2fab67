"""benchmarks/offload's rounds: the train parts in alternating order, each row the median of
its rounds with every round's step in brackets, failures and the time budget.

The smoke test runs the benchmark's CPU mode (gloo, tiny GPT) with `--rounds 2` and checks
its report against the figures each run printed as it finished.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.offload.__main__ import parse_args, run_parts
from benchmarks.offload._bf16 import goals
from benchmarks.offload._report import report
from benchmarks.offload._rounds import SKIPPED, combine, combine_rate, schedule

ROOT = Path(__file__).resolve().parents[2]
TOKENS = 2 * 64  # the smoke run's micro-batch x seq len


def _run(step_s: float, gpu: float = 1.0, host: float = 2.0, init: float = 5.0) -> dict[str, Any]:
    """One train part's result as its worker writes it (and run_part adds wall_s)."""
    return {
        "ok": True,
        "params": 10**9,
        "init_s": init,
        "step_s": step_s,
        "fastest_step_s": step_s * 0.9,
        "slowest_step_s": step_s * 1.2,
        "tokens_per_s": TOKENS / step_s,
        "gpu_peak_gib": gpu,
        "host_peak_gib": host,
        "wall_s": 30.0,
    }


def _args(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    monkeypatch.setattr(sys, "argv", ["benchmarks.offload", "--smoke", *argv])
    return parse_args()


def test_schedule_runs_other_parts_once_and_alternates_train_parts() -> None:
    parts = ["fwd-bwd", "train-zs", "adam-torch-fused", "transfer", "train-zs-dpu", "train-ds"]
    assert schedule(parts, 1) == [(p, 0) for p in parts]
    # The CPU's AdamW alone runs every round too, in its place among the train parts.
    assert schedule(parts, 3) == [
        *[(p, 0) for p in parts],
        ("train-ds", 1),
        ("train-zs-dpu", 1),
        ("adam-torch-fused", 1),
        ("train-zs", 1),
        ("train-zs", 2),
        ("adam-torch-fused", 2),
        ("train-zs-dpu", 2),
        ("train-ds", 2),
    ]


def test_combine_rate_median_of_rounds_or_first_failure() -> None:
    def rate(g: float) -> dict[str, Any]:
        return {
            "ok": True,
            "params": 10**9,
            "params_per_s": g * 1e9,
            "step_s": 1 / g,
            "wall_s": 9.0,
        }

    row = combine_rate([rate(3.72), rate(4.70), rate(4.0)], 3)
    assert row["ok"] and row["params_per_s"] == 4.0e9 and row["step_s"] == 1 / 4.0
    assert row["rounds_params_per_s"] == [3.72e9, 4.70e9, 4.0e9] and row["wall_s"] == 27.0
    crash = {"ok": False, "error": "killed", "wall_s": 1.0}
    assert combine_rate([rate(4.0), crash], 2)["error"] == "round 2/2: killed"
    skip = {"ok": False, "error": SKIPPED, "wall_s": 0.0}
    assert combine_rate([rate(4.0), skip], 2)["rounds_params_per_s"] == [4.0e9]


def test_combine_median_of_rounds_largest_peaks() -> None:
    runs = [_run(3.0, gpu=30.0, init=9.0), _run(2.0, host=90.0, init=7.0), _run(2.6, init=8.0)]
    row = combine(runs, 3, TOKENS)
    assert row["ok"] and row["step_s"] == 2.6 and row["init_s"] == 8.0
    assert row["tokens_per_s"] == TOKENS / 2.6
    assert (row["gpu_peak_gib"], row["host_peak_gib"]) == (30.0, 90.0)
    assert row["rounds_step_s"] == [3.0, 2.0, 2.6] and row["skipped_rounds"] == 0
    assert (row["fastest_step_s"], row["slowest_step_s"]) == (2.0 * 0.9, 3.0 * 1.2)
    # One round: the row is that run's figures (today's report).
    one = combine([_run(2.5)], 1, TOKENS)
    assert {k: one[k] for k in _run(2.5)} == _run(2.5)


def test_combine_failure_is_the_row_and_budget_skips_are_counted() -> None:
    crash: dict[str, Any] = {
        "ok": False,
        "error": "killed (host out of memory?), rc -9: ",
        "wall_s": 4.0,
    }
    failed = combine([_run(2.0), crash], 3, TOKENS)
    assert not failed["ok"] and failed["error"] == "round 2/3: " + crash["error"]
    assert "step_s" not in failed
    skip = {"ok": False, "error": SKIPPED, "wall_s": 0.0}
    part = combine([_run(2.0), _run(3.0), skip], 3, TOKENS)
    assert part["ok"] and part["step_s"] == 2.5 and part["skipped_rounds"] == 1
    assert combine([skip, skip], 2, TOKENS) == skip

    args = argparse.Namespace(
        preset="7b", layers=34, seq_len=2048, micro_batch=4, activation_checkpointing=True,
        steps=3, warmup=1, rounds=3, search_layers="", offload_params=False, stage=2,
        chunk=2**20, adam_steps=3, offload_ratio=0.7,
    )  # fmt: skip
    body = report(args, {"train-zs": part, "train-zs-dpu": failed})
    assert "| 2.50 (2.00 / 3.00; steps 1.80-3.60) |" in body
    assert f"| ok; 1 of 3 rounds {SKIPPED} |" in body
    assert f"| - | {failed['error']} |" in body
    assert "train-zs 60s (30 / 30)" in body


def _report_args(offload_ratio: float) -> argparse.Namespace:
    """A 7.06B stage-2 run's arguments, one round, as `report` reads them."""
    return argparse.Namespace(
        preset="7b", layers=34, seq_len=2048, micro_batch=4, activation_checkpointing=True,
        steps=3, warmup=1, rounds=1, search_layers="", offload_params=False, stage=2,
        chunk=2**20, adam_steps=3, offload_ratio=offload_ratio,
    )  # fmt: skip


def test_ratio_row_is_judged_against_its_share() -> None:
    """A `train-zs-ratio` row names its ratio, and the resources line judges it against
    the bus's and the CPU's work for the share it offloads (the others against all)."""
    args = _report_args(offload_ratio=0.5)
    resources = {
        "fwd-bwd": {"ok": True, "step_s": 0.5},
        "transfer": dict(ok=True, step_s=0.4, d2h_s=0.2, d2h_gb_per_s=50.0, h2d_s=0.2)
        | dict(h2d_gb_per_s=50.0, h2d_dtype="fp32"),
        # 2 s over the rows' 10**9 parameters.
        "adam-torch-fused": dict(ok=True, params=10**9, params_per_s=0.5e9, step_s=2.0, threads=16),
    }
    body = report(args, {**resources, "train-zs-overlap": _run(2.4), "train-zs-ratio": _run(1.5)})
    label = "zeroshard offload_optimizer, offload_ratio 0.5, step_in_backward"
    assert f"| {label} (stage 2) | 1.00B | 1.50 (steps 1.35-1.80) |" in body
    # Whole offload: against the CPU's 2 s; half of it: against max(0.5, 0.2, 1.0) = 1 s.
    assert "1.20 (zeroshard offload_optimizer, step_in_backward)" in body
    assert f"1.50 ({label}: against 1.00 s," in body


def test_cpu_step_parts_alone_have_no_training_table() -> None:
    """With only the CPU's optimizer parts run, the report has their table and no empty
    training table or model line."""
    args = _report_args(offload_ratio=0.7)
    adam = dict(ok=True, params=10**9, params_per_s=4e9, step_s=0.25, threads=16, wall_s=20.0)
    body = report(args, {"adam-torch-fused": adam, "adam-zs-host-compiled": adam})
    assert "| torch AdamW fused=True (CPU) | 1B | 4,000M |" in body
    assert body.startswith("CPU optimizer step") and "| engine |" not in body
    body = report(args, {"adam-torch-fused": adam, "train-zs-overlap": _run(2.4)})
    assert "| engine |" in body and "GPT `7b` width" in body


def test_budget_spent_skips_every_round(monkeypatch: pytest.MonkeyPatch) -> None:
    args = _args(["--parts", "fwd-bwd,train-zs", "--rounds", "2", "--budget-s", "0"], monkeypatch)
    results = run_parts(args, {})
    assert results == {
        p: {"ok": False, "error": SKIPPED, "wall_s": 0.0} for p in args.parts.split(",")
    }


@pytest.mark.parametrize(
    "argv",
    [
        ["--rounds", "0"],
        ["--rounds", "2", "--search-layers", "2,3"],
        ["--offload-ratio", "1"],
        ["--offload-ratio", "0"],
        ["--search-part", "train-zs-overlap-bf16"],
        ["--search-layers", "2,3", "--search-part", "train-ds"],
    ],
)
def test_bad_rounds_are_refused(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit):
        _args(argv, monkeypatch)


def test_a_part_listed_twice_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    args = _args(["--parts", "train-zs,fwd-bwd,train-zs", "--rounds", "2"], monkeypatch)
    with pytest.raises(SystemExit, match="lists 'train-zs' twice"):
        run_parts(args, {})


@pytest.mark.slow
def test_smoke_two_rounds_report_median_of_each_round() -> None:
    """Two rounds of two train rows on the CPU: the rows run in alternating order, and each
    row's step is the median of the rounds' steps the runs printed, shown in run order; the
    CPU's AdamW alone runs in both rounds too, and the resources line takes its median."""
    train = ["train-zs", "train-zs-overlap"]
    parts = ",".join(
        ["fwd-bwd", "transfer", "host-stream", "adam-torch-fused", "adam-zs-host", *train]
    )
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.offload", "--smoke", "--parts", parts, "--rounds", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    runs = re.findall(r"^(train-[\w-]+) \(round (\d)/2\): (\{.*\})$", out, re.M)
    assert [(p, int(i)) for p, i, _ in runs] == [
        ("train-zs", 1),
        ("train-zs-overlap", 1),
        ("train-zs-overlap", 2),
        ("train-zs", 2),
    ]
    assert "2 rounds of the training rows in alternating order" in out

    def printed(part: str, key: str) -> float:
        """`key` of the first run of `part`, as it printed when it finished."""
        found = re.search(rf'^{part}[ :].*?"{key}": ([0-9.e-]+)', out, re.M)
        assert found, (part, key)
        return float(found.group(1))

    # The CPU's AdamW alone ran first in round 1 and last in round 2, after the train rows.
    adam_runs = re.findall(r"^(adam-torch-fused|train-zs) \(round (\d)/2\): (\{.*\})$", out, re.M)
    assert [(p, int(i)) for p, i, _ in adam_runs] == [
        ("adam-torch-fused", 1),
        ("train-zs", 1),
        ("train-zs", 2),
        ("adam-torch-fused", 2),
    ]
    rates = [json.loads(r)["params_per_s"] for p, _, r in adam_runs if p == "adam-torch-fused"]
    each = " / ".join(f"{r / 1e9:.2f}" for r in rates)
    assert f"the median of 2 rounds' {each} G parameters/s, in the order run" in out
    # What the resources line divides by: the slowest of the three alone.
    cpu = printed("train-zs", "params") / statistics.median(rates)
    slowest = max(printed("fwd-bwd", "step_s"), printed("transfer", "step_s"), cpu)
    labels = ["zeroshard offload_optimizer", "zeroshard offload_optimizer, step_in_backward"]
    for part, label in zip(train, labels, strict=True):
        results = [json.loads(r) for p, _, r in runs if p == part]
        steps = [r["step_s"] for r in results]
        row = next(line for line in out.splitlines() if line.startswith(f"| {label} (stage"))
        cells = [c.strip() for c in row.split("|")[1:-1]]
        median = statistics.median(steps)
        spread = " / ".join(f"{s:.2f}" for s in steps)
        fastest = min(r["fastest_step_s"] for r in results)
        slowest_step = max(r["slowest_step_s"] for r in results)
        want = f"{median:.2f} ({spread}; steps {fastest:.2f}-{slowest_step:.2f})"
        assert cells[2] == want, (row, results)
        assert fastest <= min(steps) and max(steps) <= slowest_step
        assert cells[3] == f"{TOKENS / median:,.0f}"
        assert cells[-1] == "ok"
        # The resources line: the median step over the slowest resource alone.
        assert f"{median / slowest:.2f} ({label})" in out
    # Each row against zeroshard's own offloaded step alone, scaled to the model.
    own = printed("train-zs", "params") / printed("adam-zs-host", "params_per_s")
    medians = {
        label: statistics.median(json.loads(r)["step_s"] for p, _, r in runs if p == part)
        for part, label in zip(train, labels, strict=True)
    }
    line = next(x for x in out.splitlines() if x.startswith("step / zeroshard's offloaded"))
    assert f"alone ({own:.2f} s at" in line
    for label, m in medians.items():
        assert f"{m / own:.2f} ({label})" in line, (label, line)
    # The host memory line: the streaming rate, and the bytes a parameter moves at it.
    bw = printed("host-stream", "gb_per_s") * 1e9
    params = printed("train-zs", "params")
    assert f"Host memory streams {bw / 1e9:.0f} GB/s" in out
    assert f"for {params / 1e9:.2f}B parameters: torch's fused AdamW" in out
    for nbytes in (28, 26, 6):
        assert f"({nbytes} bytes" in out and f"{nbytes * params / bw:.2f} s" in out
    moved = 28 * statistics.median(rates) / 1e9
    assert f"(alone it moved {moved:.0f} GB/s)" in out


def _held(step_s: float, dtype: str, host_bytes: int | None, rss_gib: float) -> dict[str, Any]:
    """A train row with the dtypes and the host bytes its engine held."""
    row = {**_run(step_s, host=rss_gib), "master_dtype": dtype, "moments_dtype": dtype}
    return row if host_bytes is None else {**row, "engine_host_bytes": host_bytes}


def _goal_rows(body: str) -> dict[tuple[str, str, str], tuple[str, str]]:
    """(goal, bf16 row, against) -> (figure, status) of a bf16 goals table."""
    rows = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and "-bf16" in cells[1]:
            rows[(cells[0], cells[1], cells[2])] = (cells[3], cells[5])
    return rows


def test_bf16_goals_are_judged_from_the_rows() -> None:
    """Each goal's figure is the rows' ratio and its status the target's verdict on it; a
    failed row makes its pairs "not measured", never met."""
    fp32 = _held(3.0, "float32", 14 * 10**9, 100.0)
    bf16 = _held(1.5, "bfloat16", 7 * 10**9, 52.0)
    ds = _held(4.0, "bfloat16", None, 90.0)
    body = goals({"train-zs": fp32, "train-zs-bf16": bf16, "train-ds-bf16": ds})
    host = "host bytes a parameter, bf16 / fp32"
    assert _goal_rows(body) == {
        (f"{host} (engine's count)", "train-zs-bf16", "train-zs"): ("0.50", "met"),
        (f"{host} (host peak RSS)", "train-zs-bf16", "train-zs"): ("0.52", "MISSED"),
        ("step speed over fp32 masters, the same mode", "train-zs-bf16", "train-zs"): (
            "2.00",
            "met",
        ),
        ("step speed over DeepSpeed ZeRO-Offload", "train-zs-bf16", "train-ds-bf16"): (
            "2.67",
            "MISSED",
        ),
    }
    assert "`train-ds-bf16` ran with masters in bfloat16 and DeepSpeedCPUAdam's moments" in body
    assert "bfloat16: the same storage dtypes as zeroshard's bf16 rows" in body
    crash = {"ok": False, "error": "killed", "wall_s": 1.0}
    rows = _goal_rows(goals({"train-zs": crash, "train-zs-bf16": bf16, "train-ds": crash}))
    assert len(rows) == 4 and set(rows.values()) == {("not measured", "not measured")}
    assert goals({"train-zs": fp32}) == ""
    # Against its twin and the fastest fp32 row doing the same work (not a share's, whose
    # step is shorter for holding more on the device); rows with the lag marked as such.
    dpu = _held(1.2, "bfloat16", 7 * 10**9, 52.0)
    runs = {"train-zs-dpu-compiled": _held(2.4, "float32", 14 * 10**9, 100.0)}
    runs |= {"train-zs-overlap-compiled": fp32 | {"step_s": 2.0}}
    runs |= {"train-zs-ratio": fp32 | {"step_s": 1.0}}
    runs |= {"train-zs-dpu-compiled-bf16": dpu, "train-ds-bf16": ds}
    rows = _goal_rows(goals(runs))
    mine = "train-zs-dpu-compiled-bf16 (one-step lag)"
    twin = "train-zs-dpu-compiled (one-step lag)"
    assert rows[("step speed over fp32 masters, the same mode", mine, twin)] == ("2.00", "met")
    fastest = ("step speed over zeroshard's fastest fp32 offload row", mine)
    assert rows[(*fastest, "train-zs-overlap-compiled")] == ("1.67", "met")
    assert rows[("step speed over DeepSpeed ZeRO-Offload", mine, "train-ds-bf16")][0] == "3.33"
    assert len(rows) == 5, rows


def _smoke(tmp: Path, *argv: str) -> tuple[str, dict[str, dict[str, Any]]]:
    """A smoke run's output and its rows (`--json`)."""
    rows = tmp / "rows.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.offload", "--smoke", *argv, "--json", str(rows)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(rows.read_text())


@pytest.mark.slow
def test_smoke_bf16_row_beside_its_fp32_twin(tmp_path: Path) -> None:
    """A bf16-masters row and its fp32 twin on the CPU: each ran with the dtypes it names
    (read back from the engine), and the report's host table and goals are the ratios of
    the rows' figures."""
    out, runs = _smoke(tmp_path, "--parts", "train-zs-overlap,train-zs-overlap-bf16")
    fp32, bf16 = runs["train-zs-overlap"], runs["train-zs-overlap-bf16"]
    assert (fp32["master_dtype"], fp32["moments_dtype"]) == ("float32", "float32")
    assert (bf16["master_dtype"], bf16["moments_dtype"]) == ("bfloat16", "bfloat16")
    for r in (fp32, bf16):
        per_param = r["engine_host_bytes"] / r["params"]
        assert f"| {r['engine_host_bytes'] / 2**30:.1f} | {per_param:.2f} |" in out
    rows = _goal_rows(out)
    mine, twin = "train-zs-overlap-bf16", "train-zs-overlap"
    share = bf16["engine_host_bytes"] / fp32["engine_host_bytes"]
    host = "host bytes a parameter, bf16 / fp32 (engine's count)"
    assert rows[(host, mine, twin)][0] == f"{share:.2f}"
    speed = fp32["step_s"] / bf16["step_s"]
    want = (f"{speed:.2f}", "met" if speed >= 1.6 else "MISSED")
    assert rows[("step speed over fp32 masters, the same mode", mine, twin)] == want


@pytest.mark.slow
def test_smoke_search_beside_the_planner(tmp_path: Path) -> None:
    """The search with bf16 masters and offloaded parameters: each size beside the planner's
    prediction, whose host bytes are the engine's own count (the planner and the engine
    count the same buffers and optimizer state)."""
    argv = ["--search-layers", "2", "--stage", "3", "--offload-params"]
    out, runs = _smoke(tmp_path, *argv, "--search-part", "train-zs-overlap-bf16")
    for layers in (2,):
        r = runs[f"train-zs-overlap-bf16@{layers}"]
        assert r["ok"] and r["master_dtype"] == "bfloat16" and r["steps_run"] >= 3
        planned = r["plan"]["host_gib"] * 2**30
        assert abs(planned / r["engine_host_bytes"] - 1) < 0.01, (planned, r["engine_host_bytes"])
        assert r["plan"]["params"] == r["params"]
    assert "| engine's host bytes, planned / measured |" in out
    assert "| parameters / the previous largest (9.28B, fp32) |" in out


@pytest.mark.parametrize(
    ("waits", "labels"), [([], {"": 4}), (["--waits"], {" spinning": 8, " blocking": 4})]
)
def test_host_profile_times_the_kernel_inside_the_step(
    waits: list[str], labels: dict[str, int]
) -> None:
    """`benchmarks.offload.host_profile` wraps the step's own functions by name: a smoke
    step must reach the compiled kernel through the wrapper (a renamed function would
    leave it timing nothing); `--waits` times each kind of wait's steps apart."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.offload.host_profile", "bf16", "--smoke", *waits],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = re.findall(r"^bf16( \w+)? step \d+: .* over (\d+) pieces", proc.stdout, re.M)
    assert all(int(n) > 0 for _, n in steps), proc.stdout[-3000:]
    assert collections.Counter(label for label, _ in steps) == labels, proc.stdout[-3000:]
    for label in labels:
        assert f"| bf16 in the step{label} |" in proc.stdout, proc.stdout[-3000:]
