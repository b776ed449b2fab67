"""Untrusted DeepSpeed files: malicious pickles are refused unrun, broken files named.

Each malicious pickle would create a marker file if any of it ran; the tests check the
refusal names the global and that the marker does not exist afterwards.
"""

from __future__ import annotations

import builtins
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.ckpt._ds import deepspeed_specs
from zeroshard.ckpt import (
    CheckpointError,
    CorruptFileError,
    DeepSpeedCheckpointError,
    UnsafePickleError,
)
from zeroshard.ckpt.foreign._deepspeed_source import FlatSource, OpenFile
from zeroshard.ckpt.foreign._unpickle import FragmentAddress, LossScaler, ZeroStage, load_torch_file

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "deepspeed"
TAG = "global_step2"


class _Payload:
    """Pickles as a call of `func(*args)`; unpickling it runs the call."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.func, self.args


def _payloads(marker: Path) -> dict[str, _Payload]:
    touch = f"import pathlib; pathlib.Path({str(marker)!r}).touch()"
    return {
        os.system.__module__ + ".system": _Payload(os.system, f"touch {marker}"),
        "builtins.exec": _Payload(builtins.exec, touch),
        "builtins.eval": _Payload(builtins.eval, f"exec({touch!r})"),
        "subprocess.call": _Payload(subprocess.call, ["touch", str(marker)]),
    }


@pytest.mark.parametrize(
    "global_name", ["posix.system", "builtins.exec", "builtins.eval", "subprocess.call"]
)
def test_malicious_pickle_is_refused_and_not_run(global_name: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payloads = _payloads(marker)
    if global_name not in payloads:
        pytest.skip(f"os.system lives in {os.system.__module__} here")
    evil = tmp_path / "evil.pt"
    torch.save({"module": {"w": torch.ones(2)}, "x": payloads[global_name]}, evil)
    with pytest.raises(UnsafePickleError, match=re.escape(global_name)) as err:
        load_torch_file(evil)
    assert err.value.global_name == global_name
    assert not marker.exists()


def test_malicious_model_states_in_a_checkpoint_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "stage2", root)
    target = root / TAG / "mp_rank_00_model_states.pt"
    state = load_torch_file(target, mmap=False)
    marker = tmp_path / "pwned"
    state["client_state"] = _Payload(os.system, f"touch {marker}")
    torch.save(state, target)
    with pytest.raises(UnsafePickleError, match="refused to unpickle") as err:
        deepspeed_specs(root, None)
    assert str(target) in str(err.value)
    assert not marker.exists()
    assert isinstance(err.value, CheckpointError)


def test_unknown_but_harmless_global_is_refused_too(tmp_path: Path) -> None:
    # Only the globals DeepSpeed's files need are allowed, not everything "harmless".
    path = tmp_path / "x.pt"
    torch.save({"d": __import__("collections").defaultdict(int)}, path)
    with pytest.raises(UnsafePickleError, match=r"collections\.defaultdict"):
        load_torch_file(path)


def test_allowed_globals_become_inert_stand_ins() -> None:
    optim = FIXTURES / "stage1" / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    state = load_torch_file(optim)["optimizer_state_dict"]
    assert state["zero_stage"] == ZeroStage.optimizer_states == 1
    assert isinstance(state["loss_scaler"], LossScaler)
    assert state["loss_scaler"].cur_scale == 1.0
    mapping = state["param_slice_mappings"][0]
    assert all(isinstance(v, FragmentAddress) for v in mapping.values())
    # The stand-ins are ours; nothing of DeepSpeed was imported to build them.
    assert type(state["loss_scaler"]).__module__ == "zeroshard.ckpt.foreign._unpickle"


@pytest.mark.parametrize(
    ("case", "victim"),
    [
        ("stage3", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        ("stage2", "mp_rank_00_model_states.pt"),
        ("stage3", "zero_pp_rank_1_mp_rank_00_model_states.pt"),
    ],
)
@pytest.mark.parametrize("keep", [0.5, 0.98, 0.0])
def test_truncated_file_is_named(case: str, victim: str, keep: float, tmp_path: Path) -> None:
    root = tmp_path / case
    shutil.copytree(FIXTURES / case, root)
    path = root / TAG / victim
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CorruptFileError, match="truncated") as err:
        deepspeed_specs(root, None)
    assert victim in str(err.value)


def test_inconsistent_model_states_are_refused(tmp_path: Path) -> None:
    # A model states file whose param_shapes disagree with the optimizer partitions.
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "stage3", root)
    target = root / TAG / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    state = load_torch_file(target, mmap=False)
    state["param_shapes"][0]["fc1.weight"] = torch.Size([29, 14])
    torch.save(state, target)
    with pytest.raises(DeepSpeedCheckpointError, match=r"do not match|needs partition elements"):
        deepspeed_specs(root, None)

    state["param_shapes"] = None
    torch.save(state, target)
    with pytest.raises(DeepSpeedCheckpointError, match="not a ZeRO checkpoint"):
        deepspeed_specs(root, None)


def test_reads_bypass_the_memory_map(tmp_path: Path) -> None:
    # The fp32 partitions are read with preadv at their file offset (so the mapped pages
    # never join our resident set); the map-copy fallback must give the same bytes.
    path = FIXTURES / "stage3" / TAG / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    flat = load_torch_file(path)["optimizer_state_dict"]["fp32_flat_groups"][0]
    source = FlatSource(flat, OpenFile(path), "test")
    if hasattr(os, "preadv") and Path("/proc/self/maps").exists():
        assert source.uses_pread
    n = flat.numel()
    out = torch.full((n + 4,), float("nan"))
    source.read_into(out, 2, 1, n - 3)
    assert torch.equal(out[2 : n - 1], flat[1 : n - 2])
    assert out[:2].isnan().all() and out[n - 1 :].isnan().all()
    as_double = torch.zeros(n, dtype=torch.float64)  # another dtype: the copy fallback
    source.read_into(as_double, 0, 0, n)
    assert torch.equal(as_double, flat.double())
    with pytest.raises(CorruptFileError, match="outside"):
        source.read_into(out, 0, n - 1, 2)


def _resave_optim(path: Path, **changes: Any) -> None:
    """Rewrite a rank's optimizer file with `changes`, DeepSpeed's own objects replaced by
    plain values (our stand-ins would pickle under our module name, which is refused)."""
    state = load_torch_file(path, mmap=False)
    inner = state["optimizer_state_dict"]
    inner["loss_scaler"] = None
    inner["zero_stage"] = int(inner["zero_stage"])
    inner.pop("param_slice_mappings", None)
    inner.update(changes)
    torch.save(state, path)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"zero_stage": 0}, r"ZeRO stage 0; only stages 1, 2 and 3"),
        ({"zero_stage": 2}, r"ZeRO stage 2 does not match the model states"),
        ({"partition_count": 4}, r"partitioned over 4 ranks, but the checkpoint's world size is 2"),
    ],
)
def test_inconsistent_optimizer_states_are_refused(
    changes: dict[str, Any], message: str, tmp_path: Path
) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "stage3", root)
    _resave_optim(root / TAG / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert len(deepspeed_specs(root, None)[0]) == 11  # the plain rewrite alone still reads
    _resave_optim(root / TAG / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", **changes)
    with pytest.raises(DeepSpeedCheckpointError, match=message):
        deepspeed_specs(root, None)
