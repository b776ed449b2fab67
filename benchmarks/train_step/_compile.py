"""Compile time of the compiled engines, measured apart from their steps (`--compile-time`).

Each compiled engine (`floorc`, `fsdp2c`, `zs3c`, ...) is run twice in a child process of
one rank, on rank 0's device, with its own inductor cache directory
(TORCHINDUCTOR_CACHE_DIR): first in a fresh, empty one (cold: Dynamo, AOTAutograd,
inductor and Triton all compile), then in a second process on the same directory (warm:
what inductor and Triton saved is reused, Dynamo still traces). A child process, because
inductor and Triton also keep in-memory caches that a second engine in the same process
would reuse. The child times its first steps: compile time is what the first two steps
take beyond two steady steps (AOTAutograd compiles the backward lazily, in the first
backward; a recompile at step 2 counts too). Recompiles after step 2 are the graphs Dynamo
captured after step 2 (`torch._dynamo.utils.counters["stats"]["unique_graphs"]`), which
must stay at zero. The probe also splits the compile into its phases, from torch's own
compile-time metrics (`PHASES`; zeroshard.compile's passes are timed there too), and
counts the compile caches' hits and misses (`CACHES`): on the warm path, what still runs
and whether the FX graph and AOTAutograd caches were hit.

The main process then runs each compiled engine with the directory its probes left warm
(`cache_dir`), so its warm-up steps do not pay a cold compile again.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks._common import ROOT
from benchmarks._common._models import BenchModel
from benchmarks.train_step._engines import ENGINES
from benchmarks.train_step._settings import Settings
from zeroshard.compile import PASSES_KEY

# Steps a probe runs: 2 that may compile, then steady ones for the baseline and for the
# recompile count after step 2.
PROBE_STEPS = 5
# torchrun's variables: the child is a world of one of its own, on a port of its own (with
# TORCHELASTIC_USE_AGENT_STORE left set it would wait for torchrun's store, never its own).
_TORCHRUN_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
# The phases of a compile, each the sum of torch's compile-time metrics (`dynamo_timed`
# keys) named; a phase none of whose keys was recorded (it did not run, or another torch
# names it otherwise) is left out. Some
# nest: zeroshard's JOINT pass runs inside the joint-graph passes, codegen includes the
# scheduler's codegen, and kernel compile is what codegen waits for the compile workers.
PHASES: dict[str, tuple[str, ...]] = {
    "dynamo": ("bytecode_tracing",),
    "aot trace": ("aot_collect_metadata", "aot_trace_joint_graph"),
    "joint passes": ("_recursive_joint_graph_passes",),
    "partition": ("min_cut_rematerialization_partition",),
    "zeroshard passes": (PASSES_KEY,),
    "post-grad passes": ("_recursive_post_grad_passes",),
    "lowering": ("GraphLowering.run",),
    "scheduler": ("Scheduler.__init__",),
    "codegen": ("GraphLowering.codegen",),
    "kernel compile": ("async_compile.wait",),
}
# The compile caches' counters (`torch._dynamo.utils.counters[group][name]`).
CACHES: dict[str, tuple[str, str]] = {
    "fx graph hit": ("inductor", "fxgraph_cache_hit"),
    "fx graph miss": ("inductor", "fxgraph_cache_miss"),
    "aot hit": ("aot_autograd", "autograd_cache_hit"),
    "aot miss": ("aot_autograd", "autograd_cache_miss"),
}
# A probe that runs longer has hung (a cold compile of a 7B model takes minutes, not ten).
_PROBE_TIMEOUT_S = 600


@dataclass(frozen=True)
class Probe:
    """One child run of one engine: its compile time and how many graphs Dynamo captured."""

    compile_s: float  # the first two steps beyond two steady steps
    first_step_s: float
    steady_step_s: float
    graphs: int  # captured by the end of step 2
    recompiles: int  # captured after step 2
    phases: dict[str, float]  # seconds per phase of `PHASES` over the probe
    caches: dict[str, int]  # hits and misses per counter of `CACHES` over the probe


@dataclass(frozen=True)
class CompileTime:
    """An engine's cold and warm probes, or why they failed."""

    engine: str
    cold: Probe | None = None
    warm: Probe | None = None
    error: str | None = None


def cache_dir(root: Path, name: str) -> Path:
    """The inductor cache directory of engine `name`'s probes (and of its main-process runs)."""
    return root / name


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _phases() -> dict[str, float]:
    from torch._dynamo.utils import compilation_time_metrics

    return {
        phase: sum(sum(compilation_time_metrics[k]) for k in keys)
        for phase, keys in PHASES.items()
        if any(k in compilation_time_metrics for k in keys)
    }


def _caches() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {name: int(counters[group][key]) for name, (group, key) in CACHES.items()}


def probe(
    name: str,
    bm: BenchModel,
    settings: Settings,
    data: tuple[torch.Tensor, torch.Tensor],
    out: Path,
) -> None:
    """In the child: build, set up and step engine `name` PROBE_STEPS times; write a `Probe`
    as JSON to `out`."""
    device = settings.device
    # The process's own warm-up may have compiled: only what this engine adds counts.
    phases0, caches0 = _phases(), _caches()
    torch.manual_seed(0)
    with torch.device(device):
        model = bm.build()
    step = ENGINES[name].setup(model, settings)
    del model
    times, graphs = [], []
    for _ in range(PROBE_STEPS):
        t0 = time.perf_counter()
        step(*data)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        graphs.append(_graphs())
    steady = statistics.median(times[2:])
    result = Probe(
        compile_s=max(times[0] + times[1] - 2 * steady, 0.0),
        first_step_s=times[0],
        steady_step_s=steady,
        graphs=graphs[1],
        recompiles=graphs[-1] - graphs[1],
        phases={k: v - phases0.get(k, 0.0) for k, v in _phases().items()},
        caches={k: v - caches0[k] for k, v in _caches().items()},
    )
    out.write_text(json.dumps(result.__dict__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(name: str, directory: Path, out: Path) -> Probe:
    """Run `name`'s probe in a child process (this run's options) on inductor cache
    `directory`; its `Probe`, or RuntimeError with the child's last line of output."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _TORCHRUN_VARS and not k.startswith("TORCHELASTIC_")
    }
    env.pop("TRITON_CACHE_DIR", None)  # Triton's cache must live in the inductor directory
    env.update(TORCHINDUCTOR_CACHE_DIR=str(directory), MASTER_PORT=str(_free_port()))
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.train_step",
        *sys.argv[1:],
        "--compile-probe",
        f"{name}={out}",
    ]
    try:
        done = subprocess.run(
            cmd,
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
            timeout=_PROBE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"probe still running after {_PROBE_TIMEOUT_S} s") from e
    if done.returncode != 0 or not out.exists():
        lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
        raise RuntimeError(f"probe exited {done.returncode}: {lines[-1][:160]}")
    return Probe(**json.loads(out.read_text()))


def measure(names: list[str], root: Path) -> list[CompileTime]:
    """Cold, then warm, probe of every compiled engine in `names` (rank 0 only)."""
    results = []
    for name in names:
        if not ENGINES[name].compiled:
            continue
        directory = cache_dir(root, name)
        directory.mkdir(parents=True)  # fresh: the cold probe finds nothing to reuse
        try:
            cold = _child(name, directory, root / f"{name}-cold.json")
            warm = _child(name, directory, root / f"{name}-warm.json")
            results.append(CompileTime(name, cold, warm))
        except RuntimeError as e:
            results.append(CompileTime(name, error=str(e)))
        print(f"[train_step] compile time of {name}: {describe(results[-1])}", flush=True)
    return results


def split(p: Probe) -> str:
    """A probe's phases (seconds) and cache counters, in one line."""
    phases = ", ".join(f"{k} {v:.1f}" for k, v in p.phases.items())
    caches = ", ".join(f"{k} {v}" for k, v in p.caches.items())
    return f"{phases}; caches: {caches}"


def describe(r: CompileTime) -> str:
    """The cold and warm compile times and recompiles, then each probe's split; or the
    error."""
    if r.cold is None or r.warm is None:
        return r.error or "not measured"
    return (
        f"cold {r.cold.compile_s:.1f} s, warm {r.warm.compile_s:.1f} s, recompiles after "
        f"step 2: {r.cold.recompiles} cold, {r.warm.recompiles} warm\n"
        f"  cold: {split(r.cold)}\n  warm: {split(r.warm)}"
    )
