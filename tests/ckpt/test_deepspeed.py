"""Reading DeepSpeed ZeRO checkpoints: bit-identical to DeepSpeed's own zero_to_fp32.

The fixtures under fixtures/deepspeed/ were written by DeepSpeed 0.19.8 itself
(`make_fixtures.py`, run by `nox -s peers`): a tiny model trained two steps with ZeRO 1,
2 and 3, and DeepSpeed's `get_fp32_state_dict_from_zero_checkpoint` of each checkpoint
stored as `reference.safetensors` (+ `reference.json`: key order and shared names).
DeepSpeed itself is not needed here.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.ckpt._ds import deepspeed_specs
from zeroshard.ckpt import (
    CheckpointError,
    DeepSpeedCheckpoint,
    DeepSpeedCheckpointError,
    MissingRankFileError,
    MissingShardError,
    read_deepspeed_checkpoint,
)
from zeroshard.ckpt._spec import TensorSpec
from zeroshard.ckpt._writer import RangeSpec
from zeroshard.ckpt.foreign._deepspeed_files import is_deepspeed_checkpoint

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "deepspeed"
CASES = ["stage1", "stage1_bf16", "stage2", "stage3", "stage3_w3", "stage2_fp16", "stage3_fp16"]
TAG = "global_step2"
FROZEN = {"frozen.weight", "frozen.bias", "spare.empty"}


def _read(spec: TensorSpec) -> torch.Tensor:
    # Poison the buffer so a read that skips elements cannot pass.
    out = torch.full((spec.numel,), float("nan")).to(spec.dtype)
    spec.read(out)
    return out.view(spec.shape)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _assert_bit_identical(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(_bits(got), _bits(want)), f"{name}: values differ"


def _copy(case: str, tmp_path: Path) -> Path:
    dst = tmp_path / case
    shutil.copytree(FIXTURES / case, dst)
    return dst


@pytest.mark.parametrize("case", CASES)
def test_specs_bit_identical_to_zero_to_fp32(case: str) -> None:
    root = FIXTURES / case
    reference = load_file(root / "reference.safetensors")
    meta = json.loads((root / "reference.json").read_text())
    specs, aliases = deepspeed_specs(root, None)

    # Same names in the same order (specs, then the shared names DeepSpeed appends).
    assert [s.name for s in specs] + list(aliases) == meta["order"]
    assert aliases == meta["shared"]
    assert set(aliases).isdisjoint(s.name for s in specs)
    for spec in specs:
        got = _read(spec)
        assert got.dtype == spec.dtype
        _assert_bit_identical(spec.name, got, reference[spec.name])
    by_name = {s.name: s for s in specs}
    for alias, canonical in aliases.items():
        _assert_bit_identical(alias, _read(by_name[canonical]), reference[alias])


@pytest.mark.parametrize("case", ["stage1_bf16", "stage2", "stage3_w3"])
def test_range_reads_assemble_the_whole_tensor(case: str) -> None:
    # The writer splits big tensors into chunks (`RangeSpec.read_range`); chunks of every
    # size, crossing rank and group boundaries, must give the same bytes as one read.
    reference = load_file(FIXTURES / case / "reference.safetensors")
    for spec in deepspeed_specs(FIXTURES / case, None)[0]:
        assert isinstance(spec, RangeSpec)
        for chunk in (1, 7, 64, max(1, spec.numel)):
            out = torch.full((spec.numel,), float("nan")).to(spec.dtype)
            for start in range(0, spec.numel, chunk):
                spec.read_range(start, out[start : start + chunk])
            _assert_bit_identical(spec.name, out.view(spec.shape), reference[spec.name])


@pytest.mark.parametrize("case", CASES)
def test_layout_facts(case: str) -> None:
    ckpt = read_deepspeed_checkpoint(FIXTURES / case)
    assert isinstance(ckpt, DeepSpeedCheckpoint)
    stage = int(case[5])
    assert (ckpt.stage, ckpt.tag, ckpt.step) == (stage, TAG, 2)
    assert ckpt.world_size == (3 if case.endswith("_w3") else 2)
    assert ckpt.ds_version == "0.19.8"
    assert ckpt.aliases == {"head.weight": "embed.weight"}
    assert ckpt.buffers == {"scale", "seen"}  # `scratch` is not persistent
    dtypes = {s.name: s.dtype for s in ckpt.specs}
    assert dtypes["seen"] == torch.int64 and dtypes["scale"] == torch.float32
    assert dtypes["embed.weight"] == torch.float32  # from the fp32 master partitions
    # ZeRO 1 checkpoints record no frozen parameters, so zero_to_fp32 has none either.
    assert ckpt.frozen == (set() if stage == 1 else FROZEN)
    if stage > 1:
        compute = {"stage2": torch.bfloat16, "stage3": torch.bfloat16}.get(case, torch.float32)
        compute = torch.float16 if case.endswith("_fp16") else compute
        assert {dtypes[n] for n in FROZEN} == {compute}


@pytest.mark.parametrize("case", ["stage2", "stage3", "stage3_w3", "stage3_fp16"])
def test_frozen_params_equal_the_untrained_model(case: str) -> None:
    # An independent reference: the frozen layer never trains, so it must equal a fresh
    # model built from the same seed (cast to the compute dtype DeepSpeed kept it in).
    sys.path.insert(0, str(FIXTURES))
    try:
        from make_fixtures import TinyLM
    finally:
        sys.path.remove(str(FIXTURES))
    torch.manual_seed(0)
    fresh = TinyLM().state_dict()
    ckpt = read_deepspeed_checkpoint(FIXTURES / case)
    for spec in ckpt.specs:
        if spec.name in FROZEN:
            _assert_bit_identical(spec.name, _read(spec), fresh[spec.name].to(spec.dtype))


def test_exclude_frozen_drops_exactly_the_frozen_params() -> None:
    full, _ = deepspeed_specs(FIXTURES / "stage3", None)
    lean, aliases = deepspeed_specs(FIXTURES / "stage3", None, exclude_frozen=True)
    assert {s.name for s in full} - {s.name for s in lean} == FROZEN
    assert aliases == {"head.weight": "embed.weight"}


def test_tag_selection(tmp_path: Path) -> None:
    root = FIXTURES / "stage2"
    assert is_deepspeed_checkpoint(root) and is_deepspeed_checkpoint(root / TAG)
    names = [s.name for s in deepspeed_specs(root, None)[0]]
    assert [s.name for s in deepspeed_specs(root / TAG, None)[0]] == names
    assert [s.name for s in deepspeed_specs(root, TAG)[0]] == names
    with pytest.raises(DeepSpeedCheckpointError, match="global_step7"):
        deepspeed_specs(root, "global_step7")

    assert not is_deepspeed_checkpoint(tmp_path)
    (tmp_path / "latest").write_text("step9")
    assert not is_deepspeed_checkpoint(tmp_path)  # `latest` names nothing DeepSpeed wrote
    with pytest.raises(DeepSpeedCheckpointError, match="step9"):
        deepspeed_specs(tmp_path, None)
    (tmp_path / "latest").unlink()
    with pytest.raises(DeepSpeedCheckpointError, match="not a DeepSpeed checkpoint"):
        deepspeed_specs(tmp_path, None)


@pytest.mark.parametrize(
    ("case", "victim"),
    [
        ("stage3", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        ("stage3_w3", "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
        ("stage3", "zero_pp_rank_1_mp_rank_00_model_states.pt"),
        ("stage1", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    ],
)
def test_missing_rank_file_is_named(case: str, victim: str, tmp_path: Path) -> None:
    root = _copy(case, tmp_path)
    (root / TAG / victim).unlink()
    with pytest.raises(MissingRankFileError, match=re.escape(victim)) as err:
        deepspeed_specs(root, None)
    # Callers that handle zeroshard's own missing shards catch DeepSpeed's too.
    assert isinstance(err.value, MissingShardError) and isinstance(err.value, CheckpointError)


def test_missing_model_states_is_named(tmp_path: Path) -> None:
    root = _copy("stage2", tmp_path)
    (root / TAG / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(MissingRankFileError, match=re.escape("mp_rank_00_model_states.pt")):
        deepspeed_specs(root, None)


def test_extra_rank_file_is_refused(tmp_path: Path) -> None:
    root = _copy("stage1", tmp_path)
    d = root / TAG
    shutil.copy(
        d / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        d / "zero_pp_rank_2_mp_rank_00_optim_states.pt",
    )
    with pytest.raises(DeepSpeedCheckpointError, match=r"ranks \[2\] beyond the world size of 2"):
        deepspeed_specs(root, None)
