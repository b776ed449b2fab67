"""A script that catches zeroshard's agreed error exits with the status it chose.

Each case (ranks disagree at initialize, a failed load, a failed save, a timed-out
collective) runs 20 times on 2 gloo ranks, each rank its own process ending in a real
interpreter exit (see tests/faults/_exit_cases.py): every rank's status must be the
script's, never SIGABRT from a gloo worker still holding a tensor at finalization
(docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults._exit_cases import CASES, CHOSEN

REPO = Path(__file__).resolve().parents[2]
REPEATS = 20
# Pairs alive at once: enough to load the machine as the failure needed, few enough
# that the timed-out case still times out where it should.
CONCURRENT = 5


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_agreed_error_then_the_scripts_own_exit_status(case: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *sys.path]))
    run = subprocess.run(
        [sys.executable, "-m", "tests.faults._exit_cases", case, str(REPEATS), str(CONCURRENT)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    line = next(x for x in run.stdout.splitlines() if x.startswith("STATUSES "))
    statuses = json.loads(line.removeprefix("STATUSES "))
    assert len(statuses) == 2 * REPEATS, run.stdout
    assert statuses == [CHOSEN] * (2 * REPEATS), run.stdout + run.stderr
