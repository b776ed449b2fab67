"""Restarts from snapshots in memory end where an uninterrupted run ends.

examples/train_gpt.py (stage 3, gloo, `--snapshot-every 1`, checkpoints every 4 steps
as the fallback; stage 2 with `--offload delayed` in one test; the gradient journal,
`--snapshot-full-every K`, in the journal test and the node test's second case) is
SIGKILLed at the points tests/faults/_snapshot_job.py describes, one per attempt, under
real `torchrun --max-restarts` with c10d rendezvous. Each restart resumes from the
newest step the snapshots in shared memory cover (or, where they cover none, from disk
with one warning saying how many steps that costs), and the final fp32 weights and
every logged loss are bit-identical to a run without faults, snapshots or
checkpoints. Two torchrun agents stand for two nodes (`--nnodes=2`, 2 workers each);
one is SIGKILLed with its workers and replaced by a new agent with empty memory. Every
job's shared memory is gone at its normal end; the tests remove it whatever happens.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.faults.test_nodes import _free_port, _wait_for

JOB = Path(__file__).with_name("_snapshot_job.py")
SHM = Path("/dev/shm")
STEPS = 10
TRAIN = [
    *("--stage", "3", "--steps", str(STEPS), "--batch", "4", "--seq-len", "32"),
    *("--eval-batches", "1", "--sample", "0"),
]
FAULTY = ["--ckpt-dir", "ck", "--save-every", "4", "--snapshot-every", "1"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--monitor-interval=0.1")


def _losses(log: Path) -> dict[int, list[str]]:
    losses: dict[int, list[str]] = defaultdict(list)
    for line in log.read_text().splitlines():
        step, loss = line.split()
        losses[int(step)].append(loss)
    return losses


def _torchrun(tmp: Path, faults: str, *extra: str, nproc: int = 2) -> str:
    """One agent with `nproc` workers; its output (the job's shared memory removed after)."""
    run_id = f"snap-{uuid.uuid4().hex[:12]}"
    restarts = len(faults.split(",")) if faults else 0
    cmd = [
        *TORCHRUN,
        *(f"--nproc-per-node={nproc}", f"--max-restarts={restarts}", f"--rdzv-id={run_id}"),
        *("--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", str(JOB), faults or "-"),
        *TRAIN,
        *("--loss-log", str(tmp / "loss.log"), "--final-weights", str(tmp / "final.safetensors")),
        *extra,
    ]
    try:
        done = subprocess.run(cmd, cwd=tmp, env=ENV, capture_output=True, text=True, timeout=900)
        out = done.stdout + done.stderr
        assert done.returncode == 0, f"torchrun exited {done.returncode}:\n{out[-6000:]}"
        # A normal end removes the job's shared memory.
        assert not (SHM / f"zeroshard-{run_id}").exists()
        return out
    finally:
        shutil.rmtree(SHM / f"zeroshard-{run_id}", ignore_errors=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], dict]:
    """The uninterrupted run, without snapshots or checkpoints: weights and losses."""
    tmp = tmp_path_factory.mktemp("reference")
    _torchrun(tmp, "")
    losses = _losses(tmp / "loss.log")
    assert sorted(losses) == list(range(STEPS)) and all(len(v) == 1 for v in losses.values())
    return load_file(tmp / "final.safetensors"), losses


def _check(tmp: Path, reference: tuple[dict[str, torch.Tensor], dict]) -> None:
    ref_weights, ref_losses = reference
    weights = load_file(tmp / "final.safetensors")
    assert weights.keys() == ref_weights.keys()
    for name, t in ref_weights.items():
        assert torch.equal(weights[name], t), f"{name} differs from the uninterrupted run"
    losses = _losses(tmp / "loss.log")
    # Every loss logged, by any attempt, is the uninterrupted run's for that step.
    assert {s: set(v) for s, v in losses.items()} == {s: set(v) for s, v in ref_losses.items()}


def _resumes(out: str) -> list[tuple[int, str]]:
    found = re.findall(r"resumed from step (\d+) of (the snapshots in memory|ck)", out)
    return [(int(s), "memory" if "memory" in w else "disk") for s, w in found]


@pytest.mark.slow
def test_workers_killed_restart_from_memory(
    tmp_path: Path, reference: tuple[dict[str, torch.Tensor], dict]
) -> None:
    """Attempt 0: rank 1 killed mid-step 3; 1: killed putting its own snapshot of step 5
    in place (mid-snapshot: 5 is not complete); 2: rank 0 killed putting rank 1's
    replica of step 6 in place (mid-replication: the own copies cover 6); 3: rank 1's
    own copy of step 8 flipped (its replica covers it, one warning); 4: its replica
    flipped too (memory covers nothing: from disk, one warning; step-8 was never saved,
    its attempt was killed first, so step-4, 5 steps behind). Each restart goes on from
    memory (disk in the last), ending bit-identical. Two failures in a row: the node
    test."""
    out = _torchrun(tmp_path, "step:3,own:5,replica:6,flip:8,flipall:9", *FAULTY)
    assert _resumes(out) == [
        (3, "memory"),
        (4, "memory"),
        (6, "memory"),
        (8, "memory"),
        (4, "disk"),
    ], out[-6000:]
    assert out.count("skipped damaged snapshots") == 1 and "crc32c is" in out
    assert out.count("no step is covered by the snapshots in memory") == 1
    assert "5 step(s) behind the newest snapshot (step 9)" in out
    # How many times each step ran is not fixed: a kill in the background thread may
    # come while the training thread is a step further on.
    _check(tmp_path, reference)


@pytest.mark.slow
def test_journal_restarts_from_memory(
    tmp_path: Path, reference: tuple[dict[str, torch.Tensor], dict]
) -> None:
    """`--snapshot-full-every 4` (a gradient journal between full snapshots): full
    snapshots at steps 1 and 5, entries between (the journal goes on after a resume).
    Rank 1 killed mid-step 3 (between full snapshots: the full one of step 1 and the
    entries of 2 and 3 replayed); then, in the same block, rank 0 killed in the first
    step after that restore, before any new snapshot (two failures in a row: the replay's
    entries, put back and replicated again, are restored once more); then rank 1 killed
    as its entry of step 7 is put in place (7 not complete: 5's full snapshot and the
    entry of 6); then as it sends its entry of step 8 to rank 0 (mid-replication, the
    bytes in flight: every own copy of 8 is in place, 5 and 6-8 replayed); then, once
    the entry of step 10 is complete (a full snapshot at 9), rank 1's own copy of it
    flipped and rank 1 killed: 9 and rank 0's replica of 10, kept in its ring, restore
    10 with one warning. Bit-identical."""
    journal = (*FAULTY, "--snapshot-full-every", "4")
    out = _torchrun(tmp_path, "step:3,first,entry:7,send:8,flip:10", *journal)
    assert _resumes(out) == [
        (3, "memory"),
        (3, "memory"),
        (6, "memory"),
        (8, "memory"),
        (10, "memory"),
    ], out[-6000:]
    assert out.count("skipped damaged snapshots") == 1 and "crc32c is" in out
    assert "journal entry of rank 1 at step 10" in out
    _check(tmp_path, reference)


@pytest.mark.slow
def test_delayed_update_restarts_from_memory(tmp_path: Path) -> None:
    """`--offload delayed` at stage 2 (offload_delay_param_update: forward one step behind
    the masters): rank 1 killed mid-step 3, then mid-snapshot of step 5; each restart
    from memory gives the lag back, ending bit-identical to the uninterrupted delayed run
    (from disk, which keeps no lag, it would not)."""
    delayed = ("--stage", "2", "--offload", "delayed")
    ref = tmp_path / "reference"
    ref.mkdir()
    _torchrun(ref, "", *delayed)
    out = _torchrun(tmp_path, "step:3,own:5", *FAULTY, *delayed)
    assert _resumes(out) == [(3, "memory"), (4, "memory")], out[-6000:]
    _check(tmp_path, (load_file(ref / "final.safetensors"), _losses(ref / "loss.log")))


def _agent(
    tmp: Path, port: int, run_id: str, host: bool, faults: str, log: str, *extra: str
) -> subprocess.Popen[str]:
    conf = f"is_host={int(host)},last_call_timeout=2,keep_alive_interval=1"
    cmd = [
        *TORCHRUN,
        *("--nnodes=2", "--nproc-per-node=2", "--max-restarts=3", f"--rdzv-id={run_id}"),
        *("--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-conf={conf}"),
        *(str(JOB), faults, *TRAIN, *FAULTY, *extra),
        *("--loss-log", str(tmp / "loss.log"), "--final-weights", str(tmp / "final.safetensors")),
    ]
    # As in test_nodes.py: a node joining a later round needs a store of that round.
    env = {**ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    out = open(tmp / log, "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def reference4(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], dict]:
    """The uninterrupted run on 4 workers of one agent: weights and losses."""
    tmp = tmp_path_factory.mktemp("reference4")
    _torchrun(tmp, "", nproc=4)
    return load_file(tmp / "final.safetensors"), _losses(tmp / "loss.log")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("full_every", "lost_in"),
    [(1, 5), (3, 6)],
    ids=["snapshots", "journal"],
)
def test_node_lost_and_replaced_restarts_from_memory(
    tmp_path: Path,
    reference4: tuple[dict[str, torch.Tensor], dict],
    full_every: int,
    lost_in: int,
) -> None:
    """Node b (its agent and workers) SIGKILLed in step `lost_in`; a new node with empty
    memory takes its place: its ranks fetch their state from the replicas on node a and
    the job goes on from memory; the new node's first worker is then killed in its first
    step (a second failure before the next snapshot): again from memory. With the
    journal (`--snapshot-full-every 3`: full snapshots at 1, 4, 7) node b is lost in step
    6: both restores load the full snapshot of step 4 and replay the entries of 5 and 6,
    node b's ranks' fetched from the replica ring on node a (then put back on the new
    node and replicated again: the second restore finds 6 whole too). Bit-identical to an
    uninterrupted run at the same world size (4 workers of one agent, without snapshots
    or checkpoints)."""
    extra = ("--snapshot-full-every", str(full_every))
    run_id = f"snap-{uuid.uuid4().hex[:12]}"
    agents: list[subprocess.Popen[str]] = []
    try:
        port = _free_port()
        a = _agent(tmp_path, port, run_id, True, "-", "a.log", *extra)
        b = _agent(tmp_path, port, run_id, False, f"pause:{lost_in}:b", "b.log", *extra)
        agents += [a, b]
        b_workers = [tmp_path / f"b-{r}.pid" for r in range(2)]
        _wait_for(b_workers, [a, b], tmp_path)
        b.send_signal(signal.SIGKILL)  # the node is gone: its agent, workers and memory
        for f in b_workers:
            os.kill(int(f.read_text()), signal.SIGKILL)
        b.wait()
        b2 = _agent(tmp_path, port, run_id, False, "first", "b2.log", *extra)
        agents.append(b2)
        assert a.wait(timeout=600) == 0, (tmp_path / "a.log").read_text()[-5000:]
        assert b2.wait(timeout=60) == 0, (tmp_path / "b2.log").read_text()[-5000:]
        assert not (SHM / f"zeroshard-{run_id}").exists()  # the end removed every node's
    finally:
        for p in agents:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(SHM / f"zeroshard-{run_id}", ignore_errors=True)
    # Rank 0, which logs, may be on either node after the rendezvous.
    log_a = (tmp_path / "a.log").read_text() + (tmp_path / "b2.log").read_text()
    resumes = _resumes(log_a)
    assert len(resumes) == 2 and all(w == "memory" for _, w in resumes), log_a[-5000:]
    if full_every == 1:
        assert resumes[0][0] >= 4, log_a[-5000:]  # at most a step lost to the node
    else:  # step 6 complete before b paused: no step lost, nor one more by the second
        assert resumes == [(6, "memory"), (6, "memory")], log_a[-5000:]
    _check(tmp_path, reference4)
