"""Shared pytest settings: the device every multi-rank test runs on.

`pytest` (the `tests` nox session) runs everything on CPU ranks over gloo.
`pytest --device cuda -m gpu` (the `gpu` nox session) runs the tests marked `gpu`
on NCCL, one rank per GPU; world sizes larger than the GPU count are skipped there.
"""

from __future__ import annotations

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
