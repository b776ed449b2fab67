"""benchmarks/lightning in its CPU mode: the Lightning fit with zeroshard_stage_3, the plain
zs3 loop and Lightning's single-device run, on train_step's smoke GPT in fp32.

At fp32 on one rank the three compute the same thing in the same order: their losses must
be equal, which the report shows step by step.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._dist import free_port

pytest.importorskip("lightning")

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_run_reports_steps_and_equal_losses() -> None:
    env = {**os.environ, "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "benchmarks.lightning", "--smoke"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = (ROOT / "bench-out" / "lightning.md").read_text()
    assert "Ranks: 1 rank on the CPU over gloo" in text, text
    for run in ("lightning", "zs3"):
        assert re.search(rf"^\| `{run}` \| [\d.]+ \| [\d.]+, [\d.]+ \|", text, re.M), text
    losses = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|", text, re.M)
    assert [int(row[0]) for row in losses] == [0, 1, 2], text  # 1 warm-up + 2 timed steps
    assert all(row[1] == row[2] == row[3] for row in losses), losses
    assert "agree to 0.00e+00" in text, text
