"""A DeepSpeed run's optimizer state by parameter name, and `zeroshard-ckpt convert`.

Fixtures: `fixtures/deepspeed/resume_*` (and the consolidation cases), made by DeepSpeed
0.19.8 (make_fixtures.py, `nox -s peers`). The end-to-end resume against DeepSpeed's own
continuation is tests/engine/test_deepspeed_resume.py.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from zeroshard.ckpt import (
    CheckpointError,
    CorruptFileError,
    OutputExistsError,
    UnsafePickleError,
    consolidate,
    convert_deepspeed,
    is_converted_checkpoint,
    read_deepspeed_training_state,
    read_named_state,
)
from zeroshard.ckpt._writer import RangeSpec
from zeroshard.ckpt.foreign import _convert
from zeroshard.ckpt.foreign._unpickle import load_torch_file

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "deepspeed"
RESUME = ["resume_stage1", "resume_stage2", "resume_stage3", "resume_stage2_fp16"]


def _read(spec: RangeSpec) -> torch.Tensor:
    out = torch.empty(spec.numel, dtype=spec.dtype)
    spec.read(out)
    return out.view(spec.shape)


@pytest.mark.parametrize("case", ["resume_stage1", "resume_stage2", "resume_stage2_fp16"])
def test_moments_match_deepspeeds_own_slice_mappings(case: str) -> None:
    # An independent map: ZeRO 1/2 record where each parameter's fragment lies in each
    # rank's partition (param_slice_mappings); our layout code never reads it.
    state = read_deepspeed_training_state(FIXTURES / case)
    files = sorted((FIXTURES / case / "global_step2").glob("*optim_states.pt"))
    for key in ("exp_avg", "exp_avg_sq"):
        full: dict[str, list[torch.Tensor]] = {}
        for f in files:
            inner = load_torch_file(f)["optimizer_state_dict"]
            base = inner["base_optimizer_state"]["state"]
            for g, mapping in enumerate(inner["param_slice_mappings"]):
                for name, address in mapping.items():
                    flat = base[g][key][address.start : address.start + address.numel]
                    full.setdefault(name, []).append(flat)
        assert set(full) == set(state.optimizer_state[key])
        for name, pieces in full.items():
            got = _read(state.optimizer_state[key][name]).reshape(-1)
            assert torch.equal(got, torch.cat(pieces)), f"{key} of {name}"


def test_stage3_moments_agree_with_stage1() -> None:
    # resume_stage1 and resume_stage3 trained the same model on the same batches: their
    # Adam moments agree to fp32 rounding, though laid out entirely differently.
    one = read_deepspeed_training_state(FIXTURES / "resume_stage1")
    three = read_deepspeed_training_state(FIXTURES / "resume_stage3")
    for key in ("exp_avg", "exp_avg_sq"):
        for name, spec in one.optimizer_state[key].items():
            got, want = _read(three.optimizer_state[key][name]), _read(spec)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7, msg=f"{key} {name}")
            assert want.abs().sum() > 0, f"{key} of {name} is all zero"


def test_scalars_hyperparameters_and_loss_scale() -> None:
    state = read_deepspeed_training_state(FIXTURES / "resume_stage2_fp16")
    assert state.step == 2 and state.stage == 2 and state.world_size == 2
    assert [pg.scalars for pg in state.param_groups] == [{"step": 2.0}, {"step": 2.0}]
    assert [pg.hyperparameters["weight_decay"] for pg in state.param_groups] == [0.1, 0.0]
    assert "params" not in state.param_groups[0].hyperparameters
    assert state.loss_scale is not None
    assert (state.loss_scale.scale, state.loss_scale.good_steps) == (256.0, 2)
    assert read_deepspeed_training_state(FIXTURES / "resume_stage1").loss_scale is None
    # ZeRO-1 checkpoints keep frozen parameters only in the module's state dict.
    assert {"frozen.weight", "frozen.bias"} <= set(
        read_deepspeed_training_state(FIXTURES / "resume_stage1").masters
    )


def test_a_compiled_models_checkpoint_reads_under_the_models_names(tmp_path: Path) -> None:
    # DeepSpeed trained TiedLM compiled whole (`torch.compile(model)` before
    # deepspeed.initialize): its files name every weight `_orig_mod.<name>`. Read, it
    # holds the plain model's names (those of the same model trained uncompiled), with the
    # moments DeepSpeed's live optimizer reported under its own names.
    compiled, plain = FIXTURES / "resume_compiled_stage2", FIXTURES / "resume_tied_stage2"
    state = read_deepspeed_training_state(compiled)
    assert set(state.masters) == set(read_deepspeed_training_state(plain).masters)
    moments = load_file(compiled / "moments.safetensors")
    for key, specs in state.optimizer_state.items():
        for name, spec in specs.items():
            assert torch.equal(_read(spec), moments[f"{key}/_orig_mod.{name}"]), (key, name)
    consolidate(compiled, tmp_path / "compiled.safetensors")
    consolidate(plain, tmp_path / "plain.safetensors")
    names = load_file(tmp_path / "compiled.safetensors").keys()
    assert names == load_file(tmp_path / "plain.safetensors").keys(), sorted(names)


@pytest.mark.parametrize(
    ("case", "world", "chunk"),
    [("resume_stage3", 3, 7), ("resume_stage2_fp16", 1, 1 << 20), ("stage3_w3", 2, 64)],
)
def test_convert_keeps_every_tensor_bit_identical(
    case: str, world: int, chunk: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Small chunks make every shard span several writes, boundaries inside parameters.
    monkeypatch.setattr(_convert, "CHUNK_ELEMENTS", chunk)
    zs = tmp_path / "zs"
    out = convert_deepspeed(FIXTURES / case, zs, world_size=world, workers=2)
    assert out == zs / "step-2" and is_converted_checkpoint(zs)
    ds = read_deepspeed_training_state(FIXTURES / case)
    ours = read_named_state(zs)
    assert ours.step == ds.step and ours.world_size == world
    assert set(ours.masters) == set(ds.masters) and dict(ours.aliases) == dict(ds.aliases)
    for name, spec in ds.masters.items():
        # fp16/bf16 frozen parameters are stored widened to fp32, exactly.
        assert torch.equal(_read(ours.masters[name]), _read(spec).float()), name
    for key, specs in ds.optimizer_state.items():
        for name, spec in specs.items():
            assert torch.equal(_read(ours.optimizer_state[key][name]), _read(spec)), name
    for name, spec in ds.buffers.items():
        assert torch.equal(_read(ours.buffers[name]), _read(spec)), name
    assert [pg.names for pg in ours.param_groups] == [pg.names for pg in ds.param_groups]
    assert [pg.scalars for pg in ours.param_groups] == [pg.scalars for pg in ds.param_groups]
    assert ours.loss_scale == ds.loss_scale
    # Consolidating the converted checkpoint gives what consolidating DeepSpeed's gives.
    consolidate(zs, tmp_path / "ours.safetensors")
    consolidate(FIXTURES / case, tmp_path / "ds.safetensors")
    mine, theirs = load_file(tmp_path / "ours.safetensors"), load_file(tmp_path / "ds.safetensors")
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_convert_is_atomic_and_refuses_to_overwrite(tmp_path: Path) -> None:
    zs = tmp_path / "zs"
    convert_deepspeed(FIXTURES / "resume_stage1", zs)
    before = (zs / "step-2" / "metadata.json").read_bytes()
    with pytest.raises(OutputExistsError, match="step-2"):
        convert_deepspeed(FIXTURES / "resume_stage2", zs)
    # A truncated DeepSpeed file: an error naming it; the earlier output is untouched
    # and no temp directory is left behind.
    bad = tmp_path / "bad"
    shutil.copytree(FIXTURES / "resume_stage2", bad)
    victim = bad / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:2000])
    with pytest.raises(CorruptFileError, match="zero_pp_rank_1"):
        convert_deepspeed(bad, zs, overwrite=True)
    assert (zs / "step-2" / "metadata.json").read_bytes() == before
    assert not list(zs.glob(".*"))
    # Into the DeepSpeed checkpoint itself: refused (our `latest` would replace its own).
    latest = (bad / "latest").read_bytes()
    with pytest.raises(CheckpointError, match="inside the source"):
        convert_deepspeed(FIXTURES / "resume_stage1", FIXTURES / "resume_stage1" / "zs")
    with pytest.raises(CheckpointError, match="is the source"):
        convert_deepspeed(bad, bad)
    assert (bad / "latest").read_bytes() == latest and not (bad / "step-2").exists()


class _Payload:
    """Pickles as a call of `func(*args)`; unpickling it runs the call."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.func, self.args


def test_a_malicious_pickle_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "resume_stage2", src)
    target = src / "global_step2" / "mp_rank_00_model_states.pt"
    state = load_torch_file(target, mmap=False)
    marker = tmp_path / "pwned"
    state["client_state"] = _Payload(os.system, f"touch {marker}")
    torch.save(state, target)
    with pytest.raises(UnsafePickleError, match="refused to unpickle"):
        read_deepspeed_training_state(src)
    with pytest.raises(UnsafePickleError, match="refused to unpickle"):
        convert_deepspeed(src, tmp_path / "out")
    assert not marker.exists()
    assert not (tmp_path / "out").exists()
