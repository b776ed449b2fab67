"""The stepping thread's cores ([Note: host step threads]): cutting the main thread's
OpenMP team ends its surplus OS threads, and giving the count back regrows it. Counted
through /proc in a fresh interpreter, where no other test's threads come and go."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from zeroshard.engine.runtime.offload._threads import MAIN_KEEP, stepping_threads

_CHECK = """
import os, time, torch
from zeroshard.engine.runtime.offload._threads import MAIN_KEEP, cut_team

def os_threads():
    return len(os.listdir("/proc/self/task"))

def settled(want):
    # libgomp's released threads leave their dock asynchronously.
    deadline = time.monotonic() + 5.0
    while os_threads() != want and time.monotonic() < deadline:
        time.sleep(0.01)
    return os_threads()

torch.set_num_threads(6)
torch.empty(6 << 16).fill_(1)
grown = os_threads()
threads = cut_team()
assert threads == 6, threads
assert torch.get_num_threads() == MAIN_KEEP
cut = grown - (6 - MAIN_KEEP)
assert settled(cut) == cut, (grown, os_threads())
torch.set_num_threads(threads)
torch.empty(6 << 16).fill_(1)
assert settled(grown) == grown, (grown, os_threads())
"""


def test_cut_team_ends_the_main_teams_surplus_threads() -> None:
    if "OpenMP" not in torch.__config__.parallel_info() or not os.path.isdir("/proc/self/task"):
        pytest.skip("the team cut is libgomp's behaviour, counted through /proc")
    subprocess.run([sys.executable, "-c", _CHECK], check=True, timeout=120)


def test_stepping_threads_take_the_other_cores() -> None:
    assert stepping_threads(16) == 16 - MAIN_KEEP
    assert stepping_threads(2) == 1
