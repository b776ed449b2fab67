"""`load_safetensors`: full weights from HF safetensors, each rank reading only its shard.

The files are written with the `safetensors` library from a reference model whose buffer
was changed (so loading it shows): one fp32 file (with an extra tensor the model lacks),
and a 2-file Hugging Face index whose second file is bf16 and which stores the tied
embedding under its other name. A differently seeded model at stages 1/2/3 loads them;
its `full_state_dict` must equal what the files hold, converted to fp32, bit for bit; its
forward must equal the reference's; and the bytes each rank read must be exactly its
shard's bytes (summing to the file's parameter bytes over ranks), not the file size.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks, subtests, world_fits
from tests.engine._models import VOCAB, make_model, make_optimizer
from zeroshard.engine.state._load import SafetensorsLoadError, load_safetensors

SINGLE = "single/weights.safetensors"
SHARDED = "sharded"
FILES = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _reference() -> dict[str, torch.Tensor]:
    """The reference weights in fp32, tied weights under both names (as state_dict has)."""
    model = make_model(seed=123)
    with torch.no_grad():
        model.get_buffer("offset").mul_(-3.0)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _sharded_split(ref: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """The keys of each sharded file: tied weight as 'head.weight', the rest split in two."""
    keys = sorted(k for k in ref if k != "emb.weight")
    return keys[: len(keys) // 2], keys[len(keys) // 2 :]


def _expected(source: str) -> dict[str, torch.Tensor]:
    """What loading `source` must give, in fp32: file 2 of the index holds bf16."""
    ref = _reference()
    if source == SHARDED:
        for k in _sharded_split(ref)[1]:
            ref[k] = ref[k].to(torch.bfloat16).float()
        ref["emb.weight"] = ref["head.weight"]
    return ref


def _write(root: Path) -> None:
    ref = _reference()
    (root / "single").mkdir()
    single = {k: v for k, v in ref.items() if k != "head.weight"}  # tied: saved once
    save_file({**single, "extra.unused": torch.ones(3)}, str(root / SINGLE))
    sharded = root / SHARDED
    sharded.mkdir()
    first, second = _sharded_split(ref)
    save_file({k: ref[k] for k in first}, str(sharded / FILES[0]))
    save_file({k: ref[k].to(torch.bfloat16) for k in second}, str(sharded / FILES[1]))
    weight_map = {k: FILES[0] for k in first} | {k: FILES[1] for k in second}
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))


def _write_bad(root: Path) -> None:
    ref = {k: v for k, v in _reference().items() if k != "head.weight"}
    bad = root / "bad"
    bad.mkdir()
    save_file({k: v for k, v in ref.items() if k not in ("l1.bias", "scale")}, str(bad / "m.st"))
    save_file({**ref, "l1.weight": torch.zeros(3, 4)}, str(bad / "shape.st"))
    save_file({**ref, "l2.bias": ref["l2.bias"].long()}, str(bad / "int.st"))
    # Hand-made files: an unknown dtype, and data cut short of its header's offsets.
    header = json.dumps({"x": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    (bad / "dtype.st").write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    whole = (bad / "m.st").read_bytes()
    (bad / "short.st").write_bytes(whole[:-100])


def _shard_bytes(model: torch.nn.Module, itemsize: dict[str, int]) -> int:
    """This rank's slot bytes, from the layouts alone (padding holds no file bytes)."""
    total = 0
    for g in zs.engine_state(model).groups:
        lo, hi = g.shard_range
        for s in g.layout.slots:
            total += max(0, min(s.end, hi) - max(s.offset, lo)) * itemsize[s.name]
    return total


def _assert_forward_close(ours: torch.Tensor, ref: torch.Tensor, dtype: str) -> None:
    """fp32: elementwise. bf16: in norm (kernels round differently per device); stale
    weights would be off by about 100%, bf16 rounding by about 1%."""
    if dtype == "fp32":
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    else:
        err = float((ours - ref).norm() / ref.norm())
        assert err < 0.05, f"forward differs from the reference by {err:.1%}"


def _case(device: str, root: str, stage: int, dtype: str, source: str) -> None:
    world = dist.get_world_size()
    model = make_model(seed=stage).to(device)
    config: dict[str, object] = {
        "stage": stage,
        "compute_dtype": dtype,
        "reduce_bucket_bytes": 1500,
    }
    if stage == 3:
        config.update(min_unit_params=1, persistence_threshold=0)
    model, _ = zs.initialize(model, make_optimizer(model), config)
    tokens = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(5))
    if stage == 3:
        with torch.no_grad():  # leaves the root unit gathered: loading must drop it
            model(tokens.to(device))

    report = load_safetensors(model, Path(root) / source)

    expected = _expected(source)
    full = zs.full_state_dict(model)
    assert full.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(full[k], v), f"{k} differs from the file"
    assert report.unexpected == (("extra.unused",) if source == SINGLE else ())
    assert report.buffers == 1
    bf16 = set(_sharded_split(_reference())[1]) if source == SHARDED else set()
    itemsize = {k: 2 if k in bf16 else 4 for k in expected}
    itemsize["emb.weight"] = itemsize["head.weight"]
    assert report.buffer_bytes == expected["offset"].numel() * itemsize["offset"]
    mine = _shard_bytes(model, itemsize)
    assert report.param_bytes == mine, f"read {report.param_bytes} bytes, shard has {mine}"
    total = torch.tensor([report.param_bytes], device=device)
    dist.all_reduce(total)
    params = {k for k in expected if k not in ("offset", "head.weight")}
    file_bytes = sum(expected[k].numel() * itemsize[k] for k in params)
    assert int(total) == file_bytes, "every parameter byte is read by exactly one rank"
    if world > 1:
        assert report.param_bytes < file_bytes

    # Forward computes with the loaded weights (stage 3: the refreshed compute shards).
    ref = make_model(seed=0)
    ref.load_state_dict(expected)
    with torch.no_grad():
        ours = model(tokens.to(device)).float().cpu()
        theirs = ref(tokens)
    _assert_forward_close(ours, theirs, dtype)


def _errors(device: str, root: str) -> None:
    model = make_model(seed=1).to(device)
    model, _ = zs.initialize(model, make_optimizer(model), {"stage": 3})
    before = zs.full_state_dict(model)
    bad = Path(root) / "bad"
    for name, match in [
        ("m.st", r"2 parameter\(s\) missing .*\['l1.bias', 'scale'\]"),
        (
            "shape.st",
            r"l1.weight: the file has 'l1.weight' of shape \[3, 4\], the model's is \[29, 13\]",
        ),
        ("int.st", "l2.bias: dtype I64 is not floating point"),
        ("dtype.st", "unsupported dtype 'C64'"),
        ("short.st", "truncated or corrupt"),
        ("nothing-here", "neither a .safetensors file nor a directory"),
    ]:
        with pytest.raises(SafetensorsLoadError, match=match):
            load_safetensors(model, bad / name)
    with pytest.raises(SafetensorsLoadError, match=r"neither model\.safetensors\.index\.json"):
        load_safetensors(model, bad)
    # A file only rank 0 finds: the same error on every rank, before rank 0 reads it.
    mine = Path(root) / SINGLE if dist.get_rank() == 0 else bad / "nothing-here"
    with pytest.raises(SafetensorsLoadError, match=r"failed on rank\(s\) \[1"):
        load_safetensors(model, mine)
    after = zs.full_state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before), "a failed load changed weights"


def _all(device: str, root: str) -> None:
    cases = subtests({"stage": [1, 2, 3], "dtype": ["fp32", "bf16"], "source": [SINGLE, SHARDED]})
    run_each(cases, lambda **c: _case(device, root, **c))
    _errors(device, root)


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [2, 3])
def test_load_safetensors(world_size: int, device: str, tmp_path: Path) -> None:
    world_fits(device, world_size)
    _write(tmp_path)
    _write_bad(tmp_path)
    run_ranks(_all, world_size, device, str(tmp_path), device=device)
