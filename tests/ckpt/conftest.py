"""Checkpoints saved once per session on 3 real ranks, shared by the ckpt tests.

Spawning ranks costs seconds; the consolidation, inspect and bad-input tests all read
the same world-3 checkpoints (copying them before they damage anything).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._dist import run_ranks, world_fits
from tests.ckpt._roundtrip import round_trip


@pytest.fixture(scope="session")
def world3(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root with `s{stage}-async{0,1}/` checkpoint roots (steps 10 and 11) saved by 3
    ranks, and `reference-s{stage}.safetensors` with what the ranks trained."""
    device = str(request.config.getoption("--device"))
    world_fits(device, 3)
    root = tmp_path_factory.mktemp("world3")
    run_ranks(round_trip, 3, str(root), device, device=device)
    return root
