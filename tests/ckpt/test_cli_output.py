"""What `zeroshard-ckpt` prints: `--version`, and a summary that counts weight files only."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

from zeroshard.ckpt._cli import main

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "deepspeed" / "stage3_w3"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    try:
        want = importlib.metadata.version("zeroshard-ckpt")
    except importlib.metadata.PackageNotFoundError:  # a source tree on PYTHONPATH
        want = "(not installed: run from a source tree)"
    assert capsys.readouterr().out.strip() == f"zeroshard-ckpt {want}"


def test_summary_counts_weight_files_not_the_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hf"
    assert main(["consolidate", str(FIXTURE), str(out), "--max-shard-size", "2KB"]) == 0
    line = capsys.readouterr().out.strip()
    m = re.search(r"in (\d+) safetensors file\(s\)( and an index)? to", line)
    assert m, line
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").exists()
    assert int(m[1]) == len(shards) and m[2], line
