"""Shared pytest settings: the device every multi-rank test runs on.

`pytest` (the `tests` nox session) runs everything on CPU ranks over gloo.
`pytest --device cuda -m gpu` (the `gpu` nox session) runs the tests marked `gpu`
on NCCL, one rank per GPU; world sizes larger than the GPU count are skipped there.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="device of the ranks: cpu (gloo) or cuda (NCCL)",
    )


@pytest.fixture
def device(request: pytest.FixtureRequest) -> str:
    """The device ranks run on: 'cpu' (gloo) or 'cuda' (NCCL)."""
    return str(request.config.getoption("--device"))


@pytest.fixture(scope="session")
def deepspeed_moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DeepSpeed MoE (expert-parallel) ZeRO-2 checkpoint written by DeepSpeed itself on 2
    ranks, with its continuation (tests/engine/_ds_moe.py): made once per session."""
    from tests._dist import run_ranks
    from tests.engine._ds_moe import write_checkpoint

    root = tmp_path_factory.mktemp("deepspeed_moe")
    run_ranks(write_checkpoint, 2, str(root), timeout_s=300)
    return root
