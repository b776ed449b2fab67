"""Bad input: each case a clear error naming the problem, and nothing lost or half-made."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.ckpt._model import TinyNet, build
from zeroshard.ckpt import (
    CheckpointError,
    ChecksumError,
    FormatVersionError,
    MissingShardError,
    ModelMismatchError,
    OutputExistsError,
    consolidate,
    load,
    read_latest,
)
from zeroshard.ckpt._cli import main
from zeroshard.partition import FlatLayout


@pytest.fixture
def ckpt(world3: Path, tmp_path: Path) -> Path:
    """A private copy of a world-3 checkpoint root (latest = step-11), safe to damage."""
    root = tmp_path / "root"
    shutil.copytree(world3 / "s3-async1", root)
    return root


def _both_refuse(root: Path, tmp_path: Path, error: type[Exception], match: str) -> None:
    """load (the rank that reads the file) and consolidate both raise; no output appears."""
    with pytest.raises(error, match=match):
        for r in range(2):
            load(root, rank=r, world_size=2)
    out = tmp_path / "out"
    with pytest.raises(error, match=match):
        consolidate(root, out)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["root"]


def test_truncated_file(ckpt: Path, tmp_path: Path) -> None:
    f = ckpt / "step-11" / "rank00001.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    _both_refuse(ckpt, tmp_path, ChecksumError, r"rank00001\.safetensors: .* \(truncated file\)")


def test_bit_flip(ckpt: Path, tmp_path: Path) -> None:
    f = ckpt / "step-11" / "rank00002.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) - 5] ^= 0x10  # one bit of one float, same size
    f.write_bytes(bytes(data))
    _both_refuse(ckpt, tmp_path, ChecksumError, r"rank00002\.safetensors: crc32 is .*corrupted")
    # Without verification the damaged value would have been read silently.
    got = load(ckpt, rank=0, world_size=1, verify=False)
    assert got.meta.step == 11


def test_missing_rank_file(ckpt: Path, tmp_path: Path) -> None:
    (ckpt / "step-11" / "rank00001.safetensors").unlink()
    _both_refuse(ckpt, tmp_path, MissingShardError, r"missing rank00001\.safetensors")


def test_unknown_format_version(ckpt: Path, tmp_path: Path) -> None:
    meta = ckpt / "step-11" / "metadata.json"
    d = json.loads(meta.read_text())
    d["version"] = 8
    meta.write_text(json.dumps(d))
    _both_refuse(
        ckpt,
        tmp_path,
        FormatVersionError,
        r"format version 8 is not supported.*reads versions \(1, 2, 3, 4, 5, 6, 7\)",
    )


def test_malformed_metadata(ckpt: Path, tmp_path: Path) -> None:
    meta = ckpt / "step-11" / "metadata.json"
    meta.write_text(meta.read_text()[:100])
    _both_refuse(ckpt, tmp_path, CheckpointError, "metadata.json: metadata is not valid JSON")
    meta.unlink()  # latest now names a checkpoint without metadata
    _both_refuse(ckpt, tmp_path, MissingShardError, "names 'step-11', which has no metadata.json")
    # ... but an explicit older step is still there.
    assert load(ckpt, rank=0, world_size=1, step=10).meta.step == 10


def test_checkpoint_of_another_model(ckpt: Path) -> None:
    """Expected names/shapes (a model's state_dict()) that differ are listed, all of them."""
    expected = {k: tuple(v.shape) for k, v in TinyNet().state_dict().items()}
    load(ckpt, rank=0, world_size=2, expected=expected)  # the right model loads
    expected.pop("norm.bias")
    expected["extra.weight"] = (3, 3)
    expected["block.0.weight"] = (16, 9)
    with pytest.raises(ModelMismatchError) as e:
        load(ckpt, rank=0, world_size=2, expected=expected)
    text = str(e.value)
    assert "not in the model: norm.bias" in text
    assert "missing from the checkpoint: extra.weight" in text
    assert "block.0.weight: checkpoint (16, 8) vs model (16, 9)" in text
    # Target layouts of another model are refused the same way.
    b = build(2, 3)
    layouts = {g.name: g.layout for g in b.meta.groups}
    layouts["g1"] = FlatLayout.build([("block.0.bias", (17,))], torch.float32, 2)
    with pytest.raises(ModelMismatchError, match=r"not in the model: block\.2\.bias"):
        load(ckpt, rank=0, world_size=2, layouts=layouts)


def test_output_exists(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="exists; pass --overwrite"):
        consolidate(ckpt, out)
    assert main(["consolidate", str(ckpt), str(out)]) == 1
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert main(["consolidate", str(ckpt), str(out), "--overwrite", "--quiet"]) == 0
    # --overwrite replaces the weights only: files it never writes stay.
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt", "model.safetensors"]
    assert (out / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "root"]  # no leftovers


def test_not_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "file.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="neither a zeroshard checkpoint"):
        consolidate(tmp_path / "junk", tmp_path / "out")
    with pytest.raises(CheckpointError, match=r"neither metadata\.json nor a 'latest'"):
        load(tmp_path / "junk", rank=0, world_size=1)
    assert main(["inspect", str(tmp_path / "nowhere")]) == 1
    assert "does not exist" in capsys.readouterr().err


_DISK_FULL = textwrap.dedent(
    """
    import resource, sys
    from pathlib import Path
    from tests.ckpt._model import build
    from zeroshard.ckpt import consolidate, save

    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    b = build(1, 1)
    save(root, 1, meta=b.meta, tensors=b.ranks[0])
    # From here on no file may grow past 2 KiB: the rank file (~10 KiB) cannot be written
    # in full, nor can the one-file consolidation. Python ignores SIGXFSZ, so writes fail
    # with EFBIG, as they would with ENOSPC on a full disk.
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, resource.RLIM_INFINITY))
    for what, call in [
        ("save", lambda: save(root, 2, meta=b.meta, tensors=b.ranks[0])),
        ("consolidate", lambda: consolidate(root, out, max_shard_size=1500)),
    ]:
        try:
            call()
        except Exception as e:
            print(what, "FAILED", type(e).__name__, e)
        else:
            print(what, "SUCCEEDED")
    """
)


def test_disk_full_mid_write(tmp_path: Path) -> None:
    """A write that fails part way (file size limit, like a full disk) raises; the previous
    checkpoint stays `latest` and loadable; no output or checkpoint claims to be complete."""
    root, out = tmp_path / "root", tmp_path / "out"
    p = subprocess.run(
        [sys.executable, "-c", _DISK_FULL, str(root), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert lines[0].startswith("save FAILED CheckpointError") and "File too large" in lines[0], (
        lines
    )
    assert lines[1].startswith("consolidate FAILED CheckpointError"), lines
    assert "File too large" in lines[1] and "nothing was left" in lines[1], lines
    assert read_latest(root) == "step-1"
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
        "latest",
        "step-1",
    ]
    assert load(root, rank=0, world_size=1).meta.step == 1
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]


def test_convert_recognises_a_zeroshard_checkpoint(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`zeroshard-ckpt convert` of a zeroshard root (its two-line `latest` once read as
    DeepSpeed's pointer) or checkpoint says what it is and writes nothing."""
    out = tmp_path / "out"
    for src in (ckpt, ckpt / "step-11"):
        assert main(["convert", str(src), str(out)]) == 1
        err = capsys.readouterr().err
        assert "is a zeroshard checkpoint already" in err and "zs.load_checkpoint" in err, err
    assert not out.exists()
