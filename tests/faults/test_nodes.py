"""A node lost, then one joining: the job goes on at the world it has and ends where a
run that changed world size at the same steps ends.

Two torchrun agents on this host stand for two nodes (`--nnodes 1:2`, c10d rendezvous
on localhost, 2 gloo workers each) training examples/train_gpt.py with hybrid sharding
(`--shard-group-size 2`: shard within a node, replicate across). Node b's agent and
workers are SIGKILLed in step 5: node a's workers fail, its agent restarts them alone
(world 2), and they resume from step-4, resharding it from 2 shards replicated twice to
2 shards. In step 7 node a's workers pause and a new node b joins: node a's agent
restarts its workers for the membership change *without* counting a restart, so the two
agents' `TORCHELASTIC_RESTART_COUNT`s differ (1 and 0); `zeroshard.comm.
init_process_group` still finds one store prefix for the round (see [Note: stale store
keys after a restart]) and the job resumes from step-6 at world 4.

A job that lost a node cannot end bit-identical to one that never did: the steps at
world 2 sum gradients over another number of ranks, each with another slice of the
batch, in another order, so rounding differs (only ~1e-6 closeness is possible). The
reference therefore runs the same steps at the same worlds without faults (4 ranks to
step-4, 2 to step-6, 4 to the end): then every step replays exactly, and the final
fp32 weights are bit-identical (the issue asks for 1e-6; equality is what we measure).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

JOB = Path(__file__).with_name("_node_job.py")
STEPS = 10
TRAIN = [
    *("--stage", "3", "--steps", str(STEPS), "--batch", "4", "--seq-len", "32"),
    *("--eval-batches", "1", "--sample", "0", "--shard-group-size", "2"),
    *("--ckpt-dir", "ck", "--save-every", "2"),
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--monitor-interval=0.1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _single(tmp: Path, nproc: int, action: str) -> None:
    """One agent, run to the end (or to `stop:S`)."""
    cmd = [
        *TORCHRUN,
        *(f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0"),
        *(str(JOB), action, *TRAIN, "--final-weights", str(tmp / "final.safetensors")),
    ]
    done = subprocess.run(cmd, cwd=tmp, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"torchrun exited {done.returncode}:\n{done.stderr[-5000:]}"


def _node(tmp: Path, port: int, host: bool, action: str, log: str) -> subprocess.Popen[str]:
    conf = f"is_host={int(host)},last_call_timeout=2,keep_alive_interval=1"
    cmd = [
        *TORCHRUN,
        *("--nnodes=1:2", "--nproc-per-node=2", "--max-restarts=3", "--rdzv-id=nodes"),
        *("--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-conf={conf}"),
        *(str(JOB), action, *TRAIN, "--final-weights", str(tmp / "final.safetensors")),
    ]
    # torch's shared agent store does not publish its address to a node joining a later
    # round (docs/reliability.md): rank 0's worker hosts a store of each round instead.
    env = {**ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    out = open(tmp / log, "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)


def _wait_for(paths: list[Path], procs: list[subprocess.Popen[str]], tmp: Path) -> None:
    deadline = time.monotonic() + 300
    while not all(p.exists() and p.read_text() for p in paths):
        ended = [p.args for p in procs if p.poll() is not None]
        if ended or time.monotonic() > deadline:
            logs = "\n".join(f.read_text()[-3000:] for f in sorted(tmp.glob("*.log")))
            pytest.fail(f"no pause at {paths} (ended: {ended}):\n{logs}")
        time.sleep(0.1)


@pytest.mark.slow
def test_node_lost_then_joining(tmp_path: Path) -> None:
    ref = tmp_path / "reference"
    ref.mkdir()
    _single(ref, 4, "stop:4")
    _single(ref, 2, "stop:6")
    _single(ref, 4, "-")

    port = _free_port()
    # Node a hosts the rendezvous store (as the first node does): it must survive.
    a = _node(tmp_path, port, True, "pause:7:a", "a.log")
    b = _node(tmp_path, port, False, "pause:5:b", "b.log")
    b_workers = [tmp_path / f"b-{r}.pid" for r in range(2)]
    _wait_for(b_workers, [a, b], tmp_path)
    b.send_signal(signal.SIGKILL)  # the node is gone: its agent and its workers
    for f in b_workers:
        os.kill(int(f.read_text()), signal.SIGKILL)
    b.wait()
    _wait_for([tmp_path / f"a-{r}.pid" for r in range(2)], [a], tmp_path)
    b2 = _node(tmp_path, port, False, "-", "b2.log")
    assert a.wait(timeout=600) == 0, (tmp_path / "a.log").read_text()[-5000:]
    assert b2.wait(timeout=60) == 0, (tmp_path / "b2.log").read_text()[-5000:]

    log_a, log_b2 = (tmp_path / "a.log").read_text(), (tmp_path / "b2.log").read_text()
    # World 4 from the start, world 2 from step-4, world 4 again from step-6.
    resumed = re.findall(r"resumed from \S+ at step (\d+) \(world size", log_a)
    assert "4" in resumed and "6" in resumed, log_a[-5000:]
    counts = re.findall(r"restart count (\d+) at world (\d+)", log_a)
    assert counts == [("0", "4"), ("1", "2"), ("1", "4")], log_a[-5000:]
    # The joining node's agent counts from 0: the agents' counts differ in the last round.
    assert re.findall(r"restart count (\d+) at world (\d+)", log_b2) == [("0", "4")]
    want = load_file(ref / "final.safetensors")
    got = load_file(tmp_path / "final.safetensors")
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(got[name], t), f"{name} differs from the reference"
