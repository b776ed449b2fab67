"""Time both tools on one checkpoint, cold and warm, alternating their order; then check
that they wrote the same tensors."""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.consolidate._compare import compare_outputs
from benchmarks.consolidate._source import Source
from benchmarks.consolidate._tools import Run, evict, failure, files, read_all, run_tool

ZEROSHARD = "zeroshard"
MODES = ("cold", "warm")
GIB = 1024**3


@dataclass(frozen=True)
class Measurements:
    """Every run per (tool, mode); which of the peer's commands was timed, and why the ones
    before it were given up."""

    runs: dict[tuple[str, str], list[Run]]
    peer_label: str
    peer_failure: str
    checked: int  # tensors compared bit for bit


def _zeroshard_argv(ckpt: Path, out: Path, workers: int | None) -> list[str]:
    cli = [sys.executable, "-m", "zeroshard.ckpt._cli", "consolidate"]
    return [*cli, str(ckpt), str(out), "--quiet", *(["--workers", str(workers)] if workers else [])]


def measure_tools(
    source: Source,
    ckpt: Path,
    work: Path,
    env: dict[str, str],
    repeats: int,
    workers: int | None,
) -> Measurements:
    """`repeats` rounds cold, then as many warm, of the peer tool and zeroshard-ckpt.

    Cold: every input and output file is fsynced and evicted from the page cache before
    each run; warm: the input was just read. The order alternates from round to round, so
    neither tool always finds the other's leftovers.
    """
    inputs = files(ckpt)
    peer = source.peer
    commands = source.peer_commands
    failures: list[str] = []
    runs: dict[tuple[str, str], list[Run]] = {}
    last: dict[str, Path] = {}
    for mode in MODES:
        for i in range(repeats):
            for tool in (peer, ZEROSHARD) if i % 2 == 0 else (ZEROSHARD, peer):
                out = work / f"{tool}-{mode}-{i}"
                if tool in last:
                    shutil.rmtree(last.pop(tool), ignore_errors=True)
                while True:
                    if mode == "cold":
                        evict(inputs)
                    else:
                        read_all(inputs)
                    argv = (
                        _zeroshard_argv(ckpt, out, workers)
                        if tool == ZEROSHARD
                        else commands[0].argv(ckpt, out)
                    )
                    run = run_tool(argv, out, env)
                    if run.rc == 0 or tool == ZEROSHARD or len(commands) == 1:
                        break
                    # e.g. zero_to_fp32 --safe_serialization refuses tied weights: time the
                    # next way of running the peer (its .bin) from here on.
                    failures.append(f"`{commands[0].label}` failed: `{failure(run)}`")
                    print(failures[-1], flush=True)
                    commands = commands[1:]
                    shutil.rmtree(out, ignore_errors=True)
                if run.rc != 0:
                    raise RuntimeError(f"{tool} failed ({run.rc}):\n{run.log[-3000:]}")
                runs.setdefault((tool, mode), []).append(run)
                print(
                    f"{tool} {mode} run {i}: {run.seconds:.2f} s (fsync {run.sync_seconds:.2f} s), "
                    f"peak RSS {run.peak_rss / GIB:.2f} GiB, read {run.read_bytes / 1e9:.2f} GB "
                    f"from disk, wrote {run.out_bytes / 1e9:.2f} GB",
                    flush=True,
                )
                last[tool] = out
                # The output is evicted too, so the next cold run starts from a clean cache.
                evict(files(out))
    checked, problem = compare_outputs(last[ZEROSHARD], last[peer], peer)
    if problem:
        raise RuntimeError(f"outputs differ after {checked} tensors: {problem}")
    return Measurements(runs, commands[0].label, "; ".join(failures), checked)
