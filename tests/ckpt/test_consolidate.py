"""Consolidation: the safetensors output equals the model's state_dict() bit for bit."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.ckpt._model import TinyNet, same_bits
from zeroshard.ckpt import CheckpointError, MissingShardError, consolidate, describe
from zeroshard.ckpt._cli import main
from zeroshard.ckpt._spec import TensorSpec
from zeroshard.ckpt._writer import RangeSpec, write_safetensors


def _state_dict(world3: Path, stage: int) -> dict[str, torch.Tensor]:
    ref = load_file(str(world3 / f"reference-s{stage}.safetensors"))
    return {k.removeprefix("sd."): v for k, v in ref.items() if k.startswith("sd.")}


def _read_output(out: Path) -> dict[str, torch.Tensor]:
    files = [out] if out.suffix == ".safetensors" else sorted(out.glob("*.safetensors"))
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        part = load_file(str(f))
        assert not set(part) & set(sd), "a tensor is in two files"
        sd.update(part)
    return sd


@pytest.mark.parametrize("stage", [1, 3])
def test_consolidated_equals_state_dict(world3: Path, tmp_path: Path, stage: int) -> None:
    """Every state_dict() key, tied weight once (under the canonical name), buffers and
    frozen parameters included; a fresh model loads it and matches bit for bit."""
    want = _state_dict(world3, stage)
    out = tmp_path / "out"
    r = consolidate(world3 / f"s{stage}-async1", out, verify=True)
    assert r.verified and r.files == (out / "model.safetensors",)
    got = _read_output(out)
    assert set(got) == set(want) - {"head.weight"}
    for k, v in want.items():
        assert same_bits(got["embed.weight" if k == "head.weight" else k], v), k
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt"
    assert json.loads(meta["zeroshard.tied"]) == {"head.weight": "embed.weight"}
    model = TinyNet()
    missing, unexpected = model.load_state_dict(got, strict=False)
    assert missing == ["head.weight"] and unexpected == []  # re-tied by the module itself
    for k, v in model.state_dict().items():
        assert same_bits(v, want[k]), k
    assert r.bytes == sum(v.numel() * v.element_size() for k, v in got.items())


def test_sharded_output_and_index(world3: Path, tmp_path: Path) -> None:
    """Hugging Face shards of at most max_shard_size bytes and an index naming each."""
    want = _state_dict(world3, 3)
    out = tmp_path / "sharded"
    r = consolidate(world3 / "s3-async1", out, max_shard_size=700, workers=3)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"].values()) == set(files)
    got = _read_output(out)
    assert set(index["weight_map"]) == set(got) == set(want) - {"head.weight"}
    assert index["metadata"]["total_size"] == r.bytes
    for name, file in index["weight_map"].items():
        with safe_open(str(out / file), framework="pt") as f:
            assert name in set(f.keys())
        assert same_bits(got[name], want[name])
    for f in files:
        tensors = load_file(str(out / f))
        data = sum(t.numel() * t.element_size() for t in tensors.values())
        assert data <= 700 or len(tensors) == 1, f"{f} holds {data} bytes"


@pytest.mark.parametrize("flag,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_dtype_conversion(world3: Path, tmp_path: Path, flag: str, dtype: torch.dtype) -> None:
    """Floating tensors are cast (round to nearest, as .to() does); int64 buffers are not."""
    want = _state_dict(world3, 2)
    out = tmp_path / f"{flag}.safetensors"
    assert (
        main(["consolidate", str(world3 / "s2-async0"), str(out), "--dtype", flag, "--quiet"]) == 0
    )
    got = load_file(str(out))
    for k, v in got.items():
        w = want[k]
        assert same_bits(v, w.to(dtype) if w.is_floating_point() else w), k
    assert got["norm.num_batches_tracked"].dtype == torch.int64


def test_exclude_frozen_and_step_selection(world3: Path, tmp_path: Path) -> None:
    src = world3 / "s3-async1"
    out = tmp_path / "nofrozen"
    consolidate(src, out, exclude_frozen=True, step=10)
    got = _read_output(out)
    assert "frozen.weight" not in got and "frozen.bias" not in got and "embed.weight" in got
    with pytest.raises(MissingShardError, match="found: step-10, step-11"):
        consolidate(src, tmp_path / "x", step=99)
    assert not (tmp_path / "x").exists()


def test_workers_and_low_memory_write_identical_bytes(world3: Path, tmp_path: Path) -> None:
    src = world3 / "s1-async1"
    outs = []
    for i, kw in enumerate([{"workers": 1}, {"workers": 4}, {"workers": 2, "low_memory": True}]):
        out = tmp_path / f"o{i}.safetensors"
        consolidate(src, out, **kw)  # type: ignore[arg-type]
        outs.append(out.read_bytes())
    assert outs[0] == outs[1] == outs[2]


def test_range_specs_are_chunked_and_exact(tmp_path: Path) -> None:
    """A tensor bigger than the chunk is assembled from several range reads, in parallel
    with a plain spec and a cast, and the bytes are exact."""
    big = torch.randn(3_000_001, generator=torch.Generator().manual_seed(1))
    small = torch.arange(10, dtype=torch.int64).view(2, 5)
    calls: list[int] = []

    def read_range(start: int, out: torch.Tensor) -> None:
        calls.append(start)
        out.copy_(big[start : start + out.numel()])

    specs = [
        RangeSpec("big", (3_000_001,), torch.float32, lambda o: read_range(0, o), read_range),
        TensorSpec("small", (2, 5), torch.int64, lambda o: o.copy_(small.view(-1))),
    ]
    out = tmp_path / "big.safetensors"
    r = write_safetensors(specs, out, dtype=torch.bfloat16, low_memory=True, workers=3, verify=True)
    assert len(calls) > 2  # chunked at 8 MiB (low memory); verify adds whole reads
    got = load_file(str(out))
    assert same_bits(got["big"], big.to(torch.bfloat16)) and same_bits(got["small"], small)
    assert r.bytes == big.numel() * 2 + small.numel() * 8


def test_verify_catches_a_source_that_changed(tmp_path: Path) -> None:
    """--verify compares against a fresh read: a source that differs fails, no output left."""
    reads = [0]

    def flaky(out: torch.Tensor) -> None:
        reads[0] += 1
        out.fill_(float(reads[0]))

    out = tmp_path / "v"
    with pytest.raises(CheckpointError, match="'t' differs from its source"):
        write_safetensors([TensorSpec("t", (4,), torch.float32, flaky)], out, verify=True)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_cli_inspect_and_consolidate(
    world3: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = world3 / "s1-async1"
    assert main(["inspect", str(src)]) == 0
    text = capsys.readouterr().out
    for needle in ("zeroshard-ckpt v3", "world size", "stage", "step-11", "parameters"):
        assert needle in text, text
    s = describe(src, step=10)
    want = _state_dict(world3, 1)
    assert (s.world_size, s.stage, s.step, s.tied, s.frozen, s.buffers) == (3, 1, 10, 1, 2, 3)
    n_params = sum(
        v.numel() for k, v in want.items() if "norm.running" not in k and "batches" not in k
    )
    assert s.params == n_params - want["head.weight"].numel()
    out = tmp_path / "cli"
    argv = ["consolidate", str(src), str(out), "--max-shard-size", "1KB", "--workers", "2"]
    assert main([*argv, "--verify"]) == 0
    assert "verified" in capsys.readouterr().out
    assert (out / "model.safetensors.index.json").is_file()
    assert main(argv) == 1  # exists
    assert "exists; pass --overwrite" in capsys.readouterr().err
    bad = ["consolidate", str(src), str(tmp_path / "one.safetensors"), "--max-shard-size", "1KB"]
    assert main(bad) == 1
    assert "needs a directory OUT" in capsys.readouterr().err


def test_console_script(world3: Path, tmp_path: Path) -> None:
    """The installed `zeroshard-ckpt` entry point runs end to end."""
    exe = shutil.which("zeroshard-ckpt")
    cmd = [exe] if exe else [sys.executable, "-m", "zeroshard.ckpt._cli"]
    out = tmp_path / "m.safetensors"
    p = subprocess.run(
        [*cmd, "consolidate", str(world3 / "s3-async0"), str(out), "--verify"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert "wrote 12 tensors" in p.stdout
    assert set(load_file(str(out))) == set(_state_dict(world3, 3)) - {"head.weight"}


def test_inspect_and_consolidate_deepspeed_fixture(tmp_path: Path) -> None:
    """SRC may be a DeepSpeed checkpoint: the CLI dispatches to the DeepSpeed reader."""
    src = Path(__file__).parent / "fixtures" / "deepspeed" / "stage3"
    if not (src / "reference.safetensors").is_file():
        pytest.skip("DeepSpeed fixtures not present")
    ref = load_file(str(src / "reference.safetensors"))
    s = describe(src)
    assert s.format.startswith("deepspeed") and (s.world_size, s.stage, s.step) == (2, 3, 2)
    assert (s.tied, s.buffers) == (1, 2)
    buffers = ("scale", "seen", "head.weight")  # the two buffers, and the tied alias
    assert s.params == sum(v.numel() for k, v in ref.items() if k not in buffers)
    out = tmp_path / "ds.safetensors"
    consolidate(src, out, verify=True)
    got = load_file(str(out))
    assert set(got) == set(ref) - {"head.weight"}
    # fp32 by default, as zero_to_fp32 writes it (the frozen bf16 layer too).
    want = {k: v.float() if v.is_floating_point() else v for k, v in ref.items()}
    assert all(same_bits(got[k], want[k]) for k in got)
