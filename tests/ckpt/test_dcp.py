"""Consolidating PyTorch DCP checkpoints written by FSDP2 itself, against `dcp_to_torch_save`.

Real ranks on gloo shard a small model with `fully_shard` (odd row counts, so FSDP2's
chunks are uneven and one rank's may be empty), train a step and `dcp.save` it; the
reference is torch's own `dcp_to_torch_save` of the same directory. In one checkpoint a
layer is compiled before sharding (torchtitan's order), so torch names its weights
`fc1._orig_mod.weight`; consolidation writes them as `fc1.weight`.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from tests._dist import run_ranks
from zeroshard.ckpt import CheckpointError, CorruptFileError, UnsafePickleError, consolidate
from zeroshard.ckpt._cli import main
from zeroshard.ckpt._writer import RangeSpec
from zeroshard.ckpt.foreign._dcp import dcp_specs


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.fc1 = nn.Linear(6, 5)  # 5 rows over 2 or 3 ranks: uneven chunks
        self.norm = nn.LayerNorm(5)
        self.fc2 = nn.Linear(5, 1)  # 1 row: the other ranks' chunks are empty
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6))
        self.register_buffer("count", torch.arange(3, dtype=torch.int64))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) * self.scale.to(self.embed.weight.dtype)
        return self.fc2(self.norm(self.fc1(h)))


def _save(root: str, dtype_name: str, with_optimizer: bool, compiled: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = _Net().to(getattr(torch, dtype_name))
    if compiled:
        model.fc1 = torch.compile(model.fc1, backend="eager")  # type: ignore[assignment]
    for layer in (model.embed, model.fc1, model.fc2):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 11, (2, 4), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(tokens).float().sum().backward()
    optimizer.step()
    state: dict[str, object] = dict(model.state_dict())
    if with_optimizer:
        # A tensor-parallel style split of the second dimension: chunks that are not
        # whole rows, read whole per tensor.
        from torch.distributed.tensor import Shard, distribute_tensor

        column = torch.arange(35, dtype=torch.float32).view(5, 7)
        state["tp.weight"] = distribute_tensor(column, mesh, [Shard(1)])
        state = {"model": state, "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=root)


@pytest.fixture(scope="module")
def dcp_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`w2` (fp32, model, a column-split tensor and the optimizer saved together) and `w3`
    (bf16, model only, `fc1` compiled)."""
    root = tmp_path_factory.mktemp("dcp")
    run_ranks(_save, 2, str(root / "w2"), "float32", True, False)
    run_ranks(_save, 3, str(root / "w3"), "bfloat16", False, True)
    return {"w2": root / "w2", "w3": root / "w3"}


def _reference(src: Path, tmp: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(src, tmp / "ref.pt")
    state = torch.load(tmp / "ref.pt", weights_only=True)
    # dcp_to_torch_save keeps torch.compile's `_orig_mod.`; consolidation drops it.
    return {k.replace("_orig_mod.", ""): v for k, v in state.get("model", state).items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _load_dir(out: Path) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(f))
    return got


@pytest.mark.parametrize("case", ["w2", "w3"])
def test_consolidate_equals_dcp_to_torch_save(
    case: str, dcp_dirs: dict[str, Path], tmp_path: Path
) -> None:
    src = dcp_dirs[case]
    ref = _reference(src, tmp_path)
    prefix = "model." if case == "w2" else ""  # saved as {"model": ..., "optimizer": ...}
    # Several small output files (an HF index) and 2 workers; default dtype: fp32.
    r = consolidate(src, tmp_path / "fp32", max_shard_size=400, workers=2, verify=True)
    assert len(r.files) > 2 and (tmp_path / "fp32" / "model.safetensors.index.json").is_file()
    got = _load_dir(tmp_path / "fp32")
    assert set(got) == {prefix + k for k in ref}  # the optimizer state is skipped
    for name, want in ref.items():
        want = want.float() if want.is_floating_point() else want
        assert torch.equal(_bits(got[prefix + name]), _bits(want)), name
        assert got[prefix + name].dtype == want.dtype, name
    if case == "w3":
        # The saved dtype, as dcp_to_torch_save keeps it, bit for bit.
        out = tmp_path / "bf16.safetensors"
        assert main(["consolidate", str(src), str(out), "--dtype", "bf16", "--quiet"]) == 0
        same = load_file(out)
        assert all(torch.equal(_bits(same[k]), _bits(v)) for k, v in ref.items())


def test_compiled_layer_names(dcp_dirs: dict[str, Path], tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(dcp_dirs["w3"], tmp_path / "ref.pt")
    saved = torch.load(tmp_path / "ref.pt", weights_only=True)
    assert "fc1._orig_mod.weight" in saved  # as torch saved the compiled layer
    consolidate(dcp_dirs["w3"], tmp_path / "out.safetensors")
    got = load_file(tmp_path / "out.safetensors")
    assert "fc1.weight" in got and not any("_orig_mod" in k for k in got)
    assert torch.equal(_bits(got["fc1.weight"]), _bits(saved["fc1._orig_mod.weight"].float()))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, on purpose
def test_two_names_for_one_weight(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    w = torch.ones(3)
    dcp.save({"fc.weight": w, "fc._orig_mod.weight": w.clone()}, checkpoint_id=tmp_path / "c")
    with pytest.raises(CheckpointError, match=r"'fc.weight' and 'fc._orig_mod.weight' are both"):
        consolidate(tmp_path / "c", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_inspect(
    dcp_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ref = _reference(dcp_dirs["w3"], tmp_path)
    assert main(["inspect", str(dcp_dirs["w3"])]) == 0
    text = capsys.readouterr().out
    assert "pytorch dcp" in text
    assert f"{sum(t.numel() for t in ref.values()):,} in {len(ref)} tensors" in text


def test_column_chunks_are_read_by_range(dcp_dirs: dict[str, Path]) -> None:
    # Split along the second dimension: ranges crossing rows and chunks, a few rows read.
    specs = {s.name: s for s in dcp_specs(dcp_dirs["w2"])}
    spec = specs["model.tp.weight"]
    assert isinstance(spec, RangeSpec)
    want = torch.arange(35, dtype=torch.float32)
    for step in (1, 3, 8, 35):
        out = torch.full((spec.numel,), float("nan"))
        for start in range(0, spec.numel, step):
            spec.read_range(start, out[start : start + step])
        assert torch.equal(out, want), step
    out = torch.full((spec.numel,), float("nan"), dtype=torch.float64)
    spec.read(out)  # into another dtype: cast
    assert torch.equal(out, want.double())


def test_range_reads_assemble_every_tensor(dcp_dirs: dict[str, Path], tmp_path: Path) -> None:
    # The writer reads big tensors in pieces crossing chunk (rank) boundaries.
    ref = _reference(dcp_dirs["w3"], tmp_path)
    for spec in dcp_specs(dcp_dirs["w3"]):
        assert isinstance(spec, RangeSpec), spec.name  # FSDP2 shards rows only
        for step in (1, 4, max(1, spec.numel)):
            out = torch.full((spec.numel,), float("nan")).to(spec.dtype)
            for start in range(0, spec.numel, step):
                spec.read_range(start, out[start : start + step])
            assert torch.equal(_bits(out), _bits(ref[spec.name])), (spec.name, step)


def _broken(dcp_dirs: dict[str, Path], tmp_path: Path) -> Path:
    src = tmp_path / "ckpt"
    shutil.copytree(dcp_dirs["w3"], src)
    return src


def test_truncated_or_missing_chunk_file(dcp_dirs: dict[str, Path], tmp_path: Path) -> None:
    src = _broken(dcp_dirs, tmp_path)
    victim = src / "__1_0.distcp"
    os.truncate(victim, victim.stat().st_size // 2)
    with pytest.raises(CorruptFileError, match=r"__1_0\.distcp.*truncated or half-written"):
        consolidate(src, tmp_path / "out")
    victim.unlink()
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp is missing"):
        consolidate(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_half_written_and_foreign_metadata(dcp_dirs: dict[str, Path], tmp_path: Path) -> None:
    src = _broken(dcp_dirs, tmp_path)
    meta = src / ".metadata"
    raw = meta.read_bytes()
    meta.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CorruptFileError, match=r"\.metadata: not a readable DCP"):
        consolidate(src, tmp_path / "out")
    marker = tmp_path / "pwned"
    meta.write_bytes(pickle.dumps(_Touch(str(marker))))
    with pytest.raises(UnsafePickleError, match=r"posix\.system"):
        consolidate(src, tmp_path / "out")
    assert not marker.exists()
    meta.unlink()  # dcp.save writes .metadata last: a crash before it leaves none
    with pytest.raises(CheckpointError, match="nor a PyTorch DCP checkpoint"):
        consolidate(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


class _Touch:
    """Unpickling this runs `touch PATH` through os.system."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.path}",)
