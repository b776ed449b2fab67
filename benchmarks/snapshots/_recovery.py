"""Recovery time on simulated nodes: a node killed, a new one in its place, against a
fresh start of the same job.

Two torchrun agents on this host stand for two nodes (`--nnodes=2`, c10d rendezvous, 2
gloo workers each) running `_job.py`. Fresh start: both agents launched, until the first
step is done on every rank. Recovery: in step `kill_at` node b's workers pause, the
benchmark SIGKILLs node b's agent and workers and at once starts a new agent (empty
memory); node a's agent restarts its workers and both rendezvous; the time runs from the
kill to the first new step done on every rank, split by the workers' own clocks into
rendezvous (the kill to the last worker's interpreter start: the failure noticed, the new
agent up, the rendezvous round, the workers started), worker start (to the last rank's
process group up: imports, `init_process_group`), setup (the model built and
`initialize`d, up to `Snapshots.resume`), fetch (finding, fetching and checking the
snapshots: the slowest rank's), load (putting the state back: the slowest rank's) and
the first step.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._common import ROOT

JOB = "benchmarks.snapshots._job"
SHM = Path("/dev/shm")


@dataclass(frozen=True)
class Shape:
    """The recovery job's model and run."""

    width: int
    layers: int
    seq: int
    batch: int
    steps: int
    kill_at: int

    def args(self) -> list[str]:
        """The job's command-line options."""
        return [
            *("--width", str(self.width), "--layers", str(self.layers)),
            *("--seq", str(self.seq), "--batch", str(self.batch), "--steps", str(self.steps)),
        ]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _agent(
    cwd: Path, port: int, run_id: str, host: bool, extra: list[str], log: str
) -> subprocess.Popen[str]:
    conf = f"is_host={int(host)},last_call_timeout=2,keep_alive_interval=1"
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--monitor-interval=0.1"),
        *("--nnodes=2", "--nproc-per-node=2", "--max-restarts=1", f"--rdzv-id={run_id}"),
        *("--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-conf={conf}"),
        *("-m", JOB, *extra),
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path]),
        # A node joining a later round needs a store of that round (docs/reliability.md).
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    out = open(cwd / log, "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)


def _events(cwd: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (cwd / "events.jsonl").read_text().splitlines()]


def _finish(agents: list[subprocess.Popen[str]], cwd: Path) -> None:
    for p in agents:
        if p.wait(timeout=900) != 0:
            logs = "\n".join(f.read_text()[-3000:] for f in sorted(cwd.glob("*.log")))
            raise RuntimeError(f"an agent exited {p.returncode}:\n{logs}")


def fresh(cwd: Path, shape: Shape) -> dict[str, float]:
    """Launch to the first step done on every rank, with its parts."""
    run_id = f"bench-{uuid.uuid4().hex[:10]}"
    port = _port()
    try:
        t0 = time.time()
        agents = [
            _agent(cwd, port, run_id, h, shape.args(), f"{n}.log")
            for h, n in ((True, "a"), (False, "b"))
        ]
        _finish(agents, cwd)
    finally:
        shutil.rmtree(SHM / f"zeroshard-{run_id}", ignore_errors=True)
    ev = _events(cwd)
    return _split(ev, t0)


def recovery(cwd: Path, shape: Shape) -> dict[str, float]:
    """The kill to the first new step done on every rank, with its parts."""
    run_id = f"bench-{uuid.uuid4().hex[:10]}"
    port = _port()
    agents: list[subprocess.Popen[str]] = []
    try:
        a = _agent(cwd, port, run_id, True, shape.args(), "a.log")
        b = _agent(
            cwd, port, run_id, False, [*shape.args(), "--pause", f"{shape.kill_at}:b"], "b.log"
        )
        agents += [a, b]
        pids = [cwd / f"b-{r}.pid" for r in range(2)]
        deadline = time.monotonic() + 600
        while not all(p.exists() and p.read_text() for p in pids):
            if time.monotonic() > deadline or a.poll() is not None or b.poll() is not None:
                raise RuntimeError("node b never reached the step to kill it in")
            time.sleep(0.05)
        t_kill = time.time()
        b.send_signal(signal.SIGKILL)
        for pid in pids:
            os.kill(int(pid.read_text()), signal.SIGKILL)
        b.wait()
        b2 = _agent(cwd, port, run_id, False, shape.args(), "b2.log")
        agents.append(b2)
        _finish([a, b2], cwd)
    finally:
        for p in agents:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(SHM / f"zeroshard-{run_id}", ignore_errors=True)
    ev = [e for e in _events(cwd) if e["source"] == "memory"]
    if len(ev) != 4:
        raise RuntimeError(f"expected 4 ranks restored from memory, got {ev}")
    return {**_split(ev, t_kill), "step": float(ev[0]["step"])}


def _split(ev: list[dict[str, Any]], t0: float) -> dict[str, float]:
    """The parts of the time from `t0` to the first step done on every rank."""
    start = max(e["start"] for e in ev)
    pg = max(e["pg"] for e in ev)
    resume = max(e["resume"] for e in ev)
    resumed = max(e["resumed"] for e in ev)
    first = max(e["first"] for e in ev)
    return {
        "rendezvous": start - t0,
        "worker_start": pg - start,
        "setup": resume - pg,
        "fetch": max(e["fetch_s"] for e in ev),
        "load": max(e["load_s"] for e in ev),
        "resume": resumed - resume,
        "first_step": first - resumed,
        "total": first - t0,
        "fetched_mib": max(e["fetched_bytes"] for e in ev) / 2**20,
    }
