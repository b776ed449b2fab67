"""Restarts under real `torchrun --max-restarts` end where an uninterrupted run ends.

examples/train_gpt.py (stage 3, 2 gloo ranks, `--resume auto`, checkpoints with the
scheduler, data position and RNG states) is killed with SIGKILL at the points
tests/faults/_restart_job.py describes, one per attempt; torchrun restarts it, it
resumes from the newest complete checkpoint, and its final fp32 weights are
bit-identical to an uninterrupted run's, as is every loss it logs (also the steps
redone after a resume). Each run also leaves a '.tmp' folder (a save killed before its
commit) or a checkpoint missing a rank's file for the next attempt to skip.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("_restart_job.py")
STEPS = 10
TRAIN = [
    *("--stage", "3", "--steps", str(STEPS), "--batch", "4", "--seq-len", "32"),
    *("--eval-batches", "1", "--sample", "0"),
]


def _torchrun(tmp: Path, faults: str, *extra: str) -> tuple[str, dict[int, list[str]]]:
    """Run the job; return its output and each step's logged losses in order."""
    log = tmp / "loss.log"
    restarts = len(faults.split(",")) if faults else 0
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"),
        *(f"--max-restarts={restarts}", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0"),
        *("--monitor-interval=0.1", str(JOB), faults or "-", *TRAIN),
        *("--loss-log", str(log), "--final-weights", str(tmp / "final.safetensors"), *extra),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"torchrun exited {done.returncode}:\n{out[-5000:]}"
    losses: dict[int, list[str]] = defaultdict(list)
    for line in log.read_text().splitlines():
        step, loss = line.split()
        losses[int(step)].append(loss)
    return out, losses


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], dict]:
    """The uninterrupted run: final weights and one loss per step."""
    tmp = tmp_path_factory.mktemp("reference")
    _, losses = _torchrun(tmp, "")
    assert sorted(losses) == list(range(STEPS)) and all(len(v) == 1 for v in losses.values())
    return load_file(tmp / "final.safetensors"), losses


def _check(tmp: Path, reference: tuple[dict[str, torch.Tensor], dict], out: str) -> None:
    ref_weights, _ = reference
    weights = load_file(tmp / "final.safetensors")
    assert weights.keys() == ref_weights.keys()
    for name, t in ref_weights.items():
        assert torch.equal(weights[name], t), f"{name} differs from the uninterrupted run"


def _resumes(out: str) -> list[int]:
    return [int(s) for s in re.findall(r"resumed from \S+ at step (\d+) \(world size", out)]


@pytest.mark.slow
def test_sync_saves_killed_mid_step_at_commit_and_file_lost(
    tmp_path: Path, reference: tuple[dict[str, torch.Tensor], dict]
) -> None:
    """Attempt 0: rank 1 killed in step 3's forward (resumes from step-2). Attempt 1:
    rank 0 killed at the rename committing step-6, leaving '.step-6.tmp' (resumes from
    step-4). Attempt 2: step-8's rank 1 file lost after its commit: every rank skips
    step-8 and resumes from step-6. Then bit-identical to the uninterrupted run."""
    out, losses = _torchrun(
        tmp_path, "step:3,commit:6,lose:8", "--ckpt-dir", "ck", "--save-every", "2"
    )
    assert _resumes(out) == [2, 4, 6], out[-5000:]
    assert "skipping checkpoint ck/step-8" in out and "missing rank00001" in out
    _check(tmp_path, reference, out)
    ref_losses = reference[1]
    # Every loss logged, by any attempt, is the uninterrupted run's for that step.
    assert {s: set(v) for s, v in losses.items()} == {s: set(v) for s, v in ref_losses.items()}
    # Steps redone after each resume: 2 (killed in 3), 4-5 (killed at 6's commit), 6-7.
    assert [len(losses[s]) for s in range(STEPS)] == [1, 1, 2, 1, 2, 2, 2, 2, 1, 1]


@pytest.mark.slow
def test_async_saves_killed_mid_write_and_at_commit(
    tmp_path: Path, reference: tuple[dict[str, torch.Tensor], dict]
) -> None:
    """Async saves. Attempt 0: rank 1 killed while step-4 is written in the background
    (resumes from step-2, past the '.step-4.tmp' left). Attempt 1: rank 0 killed at the
    rename committing step-6, inside the next save (resumes from step-4). Then
    bit-identical to the uninterrupted run."""
    out, losses = _torchrun(
        tmp_path, "async:4,commit:6", "--ckpt-dir", "ck", "--save-every", "2", "--async-save"
    )
    assert _resumes(out) == [2, 4], out[-5000:]
    _check(tmp_path, reference, out)
    ref_losses = reference[1]
    assert {s: set(v) for s, v in losses.items()} == {s: set(v) for s, v in ref_losses.items()}
    assert [len(losses[s]) for s in range(STEPS)] == [1, 1, 2, 2, 2, 2, 2, 2, 1, 1]
