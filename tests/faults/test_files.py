"""Nothing the user did not ask to lose is lost: consolidation's output, `latest`,
stale temp folders, an async save pending at interpreter exit. One process, no ranks."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from zeroshard.ckpt import (
    CheckpointError,
    CheckpointMeta,
    GroupMeta,
    consolidate,
    list_checkpoints,
    load,
    save,
)
from zeroshard.ckpt._cli import main
from zeroshard.ckpt._paths import resolve
from zeroshard.ckpt._spec import TensorSpec
from zeroshard.ckpt._writer import write_safetensors
from zeroshard.partition import FlatLayout

REPO = Path(__file__).resolve().parents[2]


def _meta() -> CheckpointMeta:
    layout = FlatLayout.build([("w", (3, 5)), ("b", (5,))], torch.float32, 1)
    return CheckpointMeta(1, (GroupMeta("g", layout, {"master": torch.float32}),))


def _save(root: Path, step: int) -> None:
    n = _meta().groups[0].layout.shard_numel
    save(root, step, meta=_meta(), tensors={"g.master": torch.arange(n, dtype=torch.float32)})


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


@pytest.mark.parametrize("where", ["same", "inside", "holds", "symlink"])
def test_consolidate_refuses_output_overlapping_source(tmp_path: Path, where: str) -> None:
    root = tmp_path / "ck"
    _save(root, 1)
    src, out = root, {"same": root, "inside": root / "step-1", "holds": tmp_path}.get(where)
    if where == "symlink":
        (tmp_path / "link").symlink_to(root)
        out = tmp_path / "link"
    assert out is not None
    before = _tree(tmp_path)
    assert main(["consolidate", str(src), str(out), "--overwrite", "--quiet"]) == 1
    with pytest.raises(CheckpointError, match="choose an output outside the checkpoint"):
        consolidate(src, out, overwrite=True)
    assert _tree(tmp_path) == before  # nothing touched
    load(root, rank=0, world_size=1)  # and the checkpoint still verifies


def test_overwrite_replaces_only_the_weights(tmp_path: Path) -> None:
    root, out = tmp_path / "ck", tmp_path / "hf"
    _save(root, 1)
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "tokenizer.json").write_text('{"v": 1}')
    (out / "model-00001-of-00002.safetensors").write_bytes(b"old")
    (out / "model.safetensors.index.json").write_text("{}")
    assert main(["consolidate", str(root), str(out), "--overwrite", "--quiet"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert (out / "tokenizer.json").read_text() == '{"v": 1}'
    assert set(load_file(out / "model.safetensors")) == {"w", "b"}


@pytest.mark.parametrize("pointer", ["/etc", "..", "../elsewhere", ".step-1.tmp"])
def test_latest_outside_the_root_is_refused(tmp_path: Path, pointer: str) -> None:
    _save(tmp_path / "ck", 1)
    (tmp_path / "ck" / "latest").write_text(pointer + "\n")
    with pytest.raises(CheckpointError, match="not a checkpoint name of this root"):
        resolve(tmp_path / "ck")


def test_stale_temp_folders_are_never_checkpoints_and_go_at_next_save(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _save(root, 1)
    stale = root / ".step-2.tmp"  # what a save killed while writing leaves
    stale.mkdir()
    (stale / "rank00000.safetensors").write_bytes(b"partial")
    assert list_checkpoints(str(root)) == ["step-1"]  # a str root works too
    _save(root, 3)
    assert not stale.exists()
    assert list_checkpoints(str(root)) == ["step-1", "step-3"]


_ASYNC_EXIT = """
import sys, torch, torch.distributed as dist
sys.path[:0] = {paths!r}
from tests.faults.test_files import _meta
from zeroshard.ckpt import save
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
n = _meta().groups[0].layout.shard_numel
save({root!r}, 7, meta=_meta(), tensors={{"g.master": torch.ones(n)}}, async_save=True)
if {destroy}:
    dist.destroy_process_group()  # the commit collective cannot run any more
"""


@pytest.mark.parametrize("destroy", [False, True])
def test_async_save_pending_at_exit(tmp_path: Path, destroy: bool) -> None:
    from tests._dist import free_port

    root = tmp_path / "ck"
    code = _ASYNC_EXIT.format(
        paths=[str(REPO), *sys.path], port=free_port(), root=str(root), destroy=destroy
    )
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if destroy:  # the exit fails loudly instead of reporting success
        assert run.returncode == 1, run.stderr
        assert "'step-7' could not be committed at exit" in run.stderr, run.stderr
        assert list_checkpoints(root) == []
    else:
        assert run.returncode == 0, run.stderr
        assert list_checkpoints(root) == ["step-7"]
        assert torch.equal(load(root, rank=0, world_size=1).shard("g", "master"), torch.ones(20))


def test_skipped_fp16_steps_are_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    from zeroshard.engine.runtime._loss_scale import LossScaler

    quiet, loud = LossScaler(1024.0, 10, 1.0), LossScaler(1024.0, 10, 1.0, log_skips=True)
    with caplog.at_level("WARNING", logger="zeroshard.engine"):
        for overflow in (True, False, True):
            quiet.update(overflow)
            loud.update(overflow)
    assert quiet.skipped_steps == loud.skipped_steps == 2
    assert [r.getMessage() for r in caplog.records] == [
        "fp16 overflow: step skipped (1 so far), loss scale 1024 -> 512",
        "fp16 overflow: step skipped (2 so far), loss scale 512 -> 256",
    ]


def test_buffer_reshaped_with_the_same_numel_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    meta = CheckpointMeta(1, _meta().groups, buffers=("grid",))
    n = meta.groups[0].layout.shard_numel
    grid = torch.arange(12.0).reshape(3, 4)
    save(root, 1, meta=meta, tensors={"g.master": torch.zeros(n), "buffer.grid": grid})
    assert json.loads((root / "step-1" / "metadata.json").read_text())["buffer_shapes"] == {
        "grid": [3, 4]
    }
    # A rank file whose buffer was written (2, 6), with matching size and checksum.
    path = root / "step-1" / "rank00000.safetensors"
    tensors = load_file(path)
    tensors["buffer.grid"] = tensors["buffer.grid"].reshape(2, 6)
    save_file(tensors, path)
    data = path.read_bytes()
    text = (root / "step-1" / "metadata.json").read_text()
    d = json.loads(text)
    d["files"]["rank00000.safetensors"].update(
        bytes=len(data), digest=f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"
    )
    (root / "step-1" / "metadata.json").write_text(CheckpointMeta.from_dict(d).to_json())
    with pytest.raises(CheckpointError, match=r"buffer 'grid' has shape \(2, 6\), metadata"):
        consolidate(root, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_interrupted_overwrite_leaves_the_old_weights_readable(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    old = {"w": torch.arange(6.0).reshape(2, 3)}
    out.mkdir()
    save_file(old, out / "model.safetensors")

    def fill(t: torch.Tensor) -> None:
        t.fill_(1.0)

    def fail(t: torch.Tensor) -> None:
        raise OSError(5, "Input/output error")  # a source read failing part way

    specs = [
        TensorSpec("w", (2, 3), torch.float32, fill),
        TensorSpec("v", (4,), torch.float32, fail),
    ]
    with pytest.raises(CheckpointError, match="Input/output error"):
        write_safetensors(specs, out, overwrite=True, workers=1)
    assert sorted(p.name for p in out.parent.iterdir()) == ["hf"]  # no temp output left
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert torch.equal(load_file(out / "model.safetensors")["w"], old["w"])
