"""Resume a DeepSpeed MoE run (expert parallelism) in zeroshard, against DeepSpeed itself.

DeepSpeed 0.19.8 trains `tests/engine/_ds_moe.py`'s MoELM (its own MoE layer, 4 experts
over expert-parallel size 2, each expert started from its own values) with ZeRO-2 and
AdamW on 2 gloo ranks, saves after 2 steps and trains 2 more (the session fixture
`deepspeed_moe_checkpoint`). zeroshard builds the same model code, initialised
otherwise (seed 99, lr 1e-3: everything must come from the checkpoint), with the experts
on DeepSpeed's expert data-parallel group as a process group of their own, so rank k
holds expert-parallel rank k's experts (global experts 2k and 2k + 1), and loads the
checkpoint at stages 2 and 3: before any step every parameter's Adam moments and step
equal what DeepSpeed's live optimizer held (bit for bit), and the 2 steps after give
DeepSpeed's losses (rtol 1e-6) and weights (atol 1e-6), every expert's included, with
`gradient_divide_factor` the world (DeepSpeed divides an expert's gradient by the whole
data-parallel world; without the factor the losses miss DeepSpeed's).
Mismatches are refused by name; `consolidate` writes every expert under its global name,
bit for bit DeepSpeed's own expert files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import zeroshard.engine as zs
from tests._dist import run_ranks
from tests.engine import _ds_moe as moe
from tests.engine.test_deepspeed_resume import _adam_state_by_name
from zeroshard.ckpt import CheckpointError, ModelMismatchError, consolidate
from zeroshard.comm import Group


def _build(
    stage: int, own: bool = True, divide: bool = True
) -> tuple[torch.nn.Module, zs.ZeroOptimizer]:
    torch.manual_seed(99)
    model = moe.MoELM()
    edp = moe.expert_data_group(model)
    opt = torch.optim.AdamW(moe.param_groups(model), lr=1e-3)
    cfg = {"stage": stage}
    if stage == 3:
        cfg.update(min_unit_params=1, persistence_threshold=0)
    if not own:
        return zs.initialize(model, opt, cfg)
    # DeepSpeed's division of the experts' gradients: by the whole data-parallel world.
    factor = dist.get_world_size() if divide else None
    groups = {moe.EXPERTS_PATH: Group(edp)}
    return zs.initialize(model, opt, cfg, process_groups=groups, gradient_divide_factor=factor)


def _continue(model: torch.nn.Module, opt: zs.ZeroOptimizer) -> list[float]:
    """The 2 steps DeepSpeed took after its save; the world's mean loss of each."""
    losses = []
    for batch in moe.batches()[moe.STEPS :]:
        loss = moe.loss_fn(model, moe.rows(batch))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses


def _resume(root: str) -> None:
    moe.deepspeed_module()
    ref = json.loads(Path(root, "resume.json").read_text())
    moments = load_file(f"{root}/moments.safetensors")
    continued = load_file(f"{root}/continued.safetensors")
    for stage in (2, 3):
        model, opt = _build(stage)
        assert zs.load_checkpoint(model, opt, root) == moe.STEPS
        assert all(pg["lr"] == 1e-2 for pg in opt.param_groups), "lr comes from the checkpoint"
        state = _adam_state_by_name(model, opt)
        assert len(state) == len(list(model.named_parameters()))
        for name, held in state.items():
            assert held["step"] == ref["adam_step"], name
            for key in ("exp_avg", "exp_avg_sq"):
                want = moments[f"{key}/{moe.global_name(name)}"]
                assert torch.equal(held[key], want), f"stage {stage}: {key} of {name}"
        losses = _continue(model, opt)
        torch.testing.assert_close(losses, ref["losses"], rtol=1e-6, atol=0)
        got = zs.full_state_dict(model)
        assert {moe.LOCAL + "1.up.weight", "moe.deepspeed_moe.gate.wg.weight"} <= got.keys()
        for name, value in got.items():
            want = continued[moe.global_name(name)]
            torch.testing.assert_close(value, want, rtol=0, atol=1e-6, msg=name)
    # Without the factor the experts' gradients are the expert-parallel size too large:
    # DeepSpeed's continuation is missed.
    model, opt = _build(2, divide=False)
    zs.load_checkpoint(model, opt, root)
    losses = _continue(model, opt)
    assert not torch.allclose(torch.tensor(losses), torch.tensor(ref["losses"]), rtol=1e-6, atol=0)


def _refusals(root: str, fewer: str) -> None:
    moe.deepspeed_module()
    # The experts left on the data-parallel group: one value of each, where the
    # checkpoint holds one per expert-parallel rank.
    model, opt = _build(2, own=False)
    with pytest.raises(ModelMismatchError, match=r"once per expert-parallel rank \(2\)"):
        zs.load_checkpoint(model, opt, root)
    # Another expert-parallel size: both ranks' experts on one group of both.
    torch.manual_seed(0)
    model = moe.MoELM()
    opt = torch.optim.AdamW(moe.param_groups(model), lr=1e-3)
    model, opt = zs.initialize(model, opt, {"stage": 2}, process_groups={moe.EXPERTS_PATH: Group()})
    with pytest.raises(ModelMismatchError, match="on 2 expert-parallel ranks, your model on 1"):
        zs.load_checkpoint(model, opt, root)
    # Another expert count: 2 experts (one a rank) where DeepSpeed trained 4.
    model = moe.MoELM(experts=2)
    opt = torch.optim.AdamW(moe.param_groups(model), lr=1e-3)
    edp = Group(moe.expert_data_group(model))
    model, opt = zs.initialize(model, opt, {"stage": 2}, process_groups={moe.EXPERTS_PATH: edp})
    with pytest.raises(ModelMismatchError, match=r"deepspeed_experts\.1\.up\.weight"):
        zs.load_checkpoint(model, opt, root)
    # An expert file missing: named on every rank.
    model, opt = _build(2)
    with pytest.raises(CheckpointError, match="missing layer_0_expert_3_mp_rank_00"):
        zs.load_checkpoint(model, opt, fewer)


def _resume_and_refusals(root: str, fewer: str) -> None:
    _resume(root)
    _refusals(root, fewer)


def test_moe_resume_matches_deepspeed(deepspeed_moe_checkpoint: Path, tmp_path: Path) -> None:
    """DeepSpeed's MoE checkpoint at stages 2 and 3 on 2 ranks, each expert on its own
    group: DeepSpeed's moments and step, then its losses and weights; then the
    mismatches, each refused by name on every rank (one spawn)."""
    fewer = tmp_path / "fewer"
    shutil.copytree(deepspeed_moe_checkpoint, fewer)
    (fewer / moe.TAG / "layer_0_expert_3_mp_rank_00_model_states.pt").unlink()
    run_ranks(_resume_and_refusals, 2, str(deepspeed_moe_checkpoint), str(fewer), timeout_s=300)


def test_moe_consolidates_every_expert(deepspeed_moe_checkpoint: Path, tmp_path: Path) -> None:
    """Every expert under its global name, bit for bit DeepSpeed's expert files (fp32
    here, as its masters), the rest DeepSpeed's module weights."""
    out = tmp_path / "model.safetensors"
    consolidate(deepspeed_moe_checkpoint, out)
    got = load_file(out)
    tag = deepspeed_moe_checkpoint / moe.TAG
    want = dict(torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)["module"])
    for e in range(moe.EXPERTS):
        want.update(torch.load(tag / f"layer_0_expert_{e}_mp_rank_00_model_states.pt"))
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
