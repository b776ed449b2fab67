"""benchmarks/snapshots' overhead part, the smoke run on the CPU: every mode runs with
its profile of each take (which broke once without a test: the profile wraps the
snapshots' own methods, whose signatures change)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests._dist import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_overhead_profiles_every_mode() -> None:
    env = {**os.environ, "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "benchmarks.snapshots", "--smoke", "--part", "overhead"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for mode in ("none", "snapshot", "dcp-async", "journal"):
        assert re.search(rf"^\| {mode} \|", done.stdout, re.M), (mode, done.stdout[-3000:])
    for kind in ("full", "entry"):
        assert re.search(rf"^\| journal every 2 \| later \| {kind} \|", done.stdout, re.M)
