"""`zeroshard-ckpt --version` prints the installed distribution's version and exits 0."""

from __future__ import annotations

import importlib.metadata

import pytest

from zeroshard.ckpt._cli import main


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    try:
        want = importlib.metadata.version("zeroshard-ckpt")
    except importlib.metadata.PackageNotFoundError:  # a source tree on PYTHONPATH
        want = "(not installed: run from a source tree)"
    assert capsys.readouterr().out.strip() == f"zeroshard-ckpt {want}"
