"""Experts split over tensor parallelism, loaded at another tensor-parallel size.

test_expert_compositions.py's trunk and experts (each expert's Linears column-, then
row-wise over tp), with AdamW and clipping, on 4 gloo ranks; rank r holds expert r // 2
throughout. The uninterrupted run, at dp 2 x tp 2 (stage 3, each expert alone on its
data-parallel rank's group, split over its tp ranks), trains 2 steps and saves; its
masters and Adam moments (`full_state_dict`, `full_optimizer_state`) and the weights one
more step gives are what the loads must give. Each expert's tp pieces are recut on load:

- tp 2 -> tp 1 at dp 4 (no mesh, stage 2, expert e sharded over ranks {2e, 2e + 1}, each
  stepping on half of the batch rank 2e had), by `resume_checkpoint`; saved there;
- tp 1 -> tp 2: that checkpoint at dp 2 x tp 2 again.

Each load gives the saved masters and moments bit for bit, and one more step from there
the uninterrupted run's weights (fp32, rtol 1e-5, as test_tensor_parallel_state.py's
loads at another shape). Another number of experts (one shared by every rank) is refused
by name on every rank; a checkpoint without `expert_split` (written before it was) by
`load` and `consolidate`.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard.engine as zs
from tests._dist import run_ranks
from tests.engine._models import global_batches
from tests.engine.test_expert_compositions import MAX_NORM, _config, _trunk
from tests.engine.test_expert_groups import _loss
from zeroshard.ckpt import CheckpointError, CheckpointMeta, ModelMismatchError, consolidate, load
from zeroshard.comm import Group

SAVED_AT = 2  # steps before the save; one more after it


def _batches() -> torch.Tensor:
    """[SAVED_AT + 1, dp 2, 2, seq + 1]: data-parallel rank d's batch of each step."""
    return global_batches(SAVED_AT + 1, 1, 2, 2)[:, 0]


def _build(
    seed: int, group: Group, stage: int, mesh: Any = None
) -> tuple[nn.Module, zs.ZeroOptimizer]:
    """The trunk with an expert of seed `seed` on `group`, split over `mesh["tp"]` when
    given."""
    model = _trunk(seed)
    if mesh is not None:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        parallelize_module(
            model.expert, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()}
        )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    return zs.initialize(
        model, opt, _config(stage), process_groups={"expert": group}, device_mesh=mesh
    )


def _step(model: nn.Module, zopt: zs.ZeroOptimizer, batch: torch.Tensor) -> None:
    _loss(model, batch).backward()
    zopt.clip_grad_norm_(MAX_NORM)
    zopt.step()
    zopt.zero_grad()


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's master and Adam moments, whole (collective)."""
    out = dict(zs.full_state_dict(model))
    for name in [n for n, _ in model.named_parameters()]:
        for key, value in zs.full_optimizer_state(model, name).items():
            if key != "step":
                out[f"{name}:{key}"] = value
    return out


def _tp_mesh() -> Any:
    """dp 2 x tp 2."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _check(
    model: nn.Module,
    zopt: zs.ZeroOptimizer,
    want: dict[str, dict[str, torch.Tensor]],
    batch: torch.Tensor,
    what: str,
) -> None:
    """The load gave the saved masters and moments (`want["saved"]`) bit for bit; one step
    on `batch` the uninterrupted run's weights (`want["after"]`)."""
    got = _state(model)
    assert got.keys() == want["saved"].keys(), what
    for name, value in want["saved"].items():
        assert torch.equal(got[name], value), f"{what}: {name}"
    _step(model, zopt, batch)
    after = zs.full_state_dict(model)
    for name, value in want["after"].items():
        torch.testing.assert_close(after[name], value, rtol=1e-5, atol=1e-6, msg=f"{what}: {name}")


def _across_sizes(root: str) -> None:
    """Rank r holds expert r // 2 throughout: its tp piece r % 2 at dp 2 x tp 2, half of
    it (its shard over the pair {2e, 2e + 1}) at dp 4."""
    rank, expert = dist.get_rank(), dist.get_rank() // 2
    alone = [Group(dist.new_group([r])) for r in range(4)]
    pairs = [Group(dist.new_group([2 * e, 2 * e + 1])) for e in range(2)]
    world = Group(dist.new_group(list(range(4))))
    batches = _batches()
    at_tp2, at_dp4 = batches[SAVED_AT, expert], batches[SAVED_AT, expert].chunk(2)[rank % 2]

    # The uninterrupted run, at dp 2 x tp 2.
    model, zopt = _build(expert, alone[rank], 3, _tp_mesh())
    for step in range(SAVED_AT):
        _step(model, zopt, batches[step, expert])
    zs.save_checkpoint(model, zopt, f"{root}/tp2", step=SAVED_AT)
    want = {"saved": _state(model)}
    _step(model, zopt, at_tp2)
    want["after"] = zs.full_state_dict(model)

    # One expert where the checkpoint has two: refused on every rank.
    model, zopt = _build(7, world, 2)
    with pytest.raises(ModelMismatchError, match=r"saved with 2 instance\(s\).* this run has 1"):
        zs.load_checkpoint(model, zopt, f"{root}/tp2")

    # tp 2 -> 1 at dp 4 (stage 2); saved there at tp 1. Other values: the load replaces them.
    model, zopt = _build(rank + 7, pairs[expert], 2)
    assert zs.resume_checkpoint(model, zopt, f"{root}/tp2") == SAVED_AT
    zs.save_checkpoint(model, zopt, f"{root}/tp1", step=SAVED_AT)
    _check(model, zopt, want, at_dp4, "tp 2 -> 1 at dp 4")

    # tp 1 -> 2 at dp 2.
    model, zopt = _build(rank + 7, alone[rank], 3, _tp_mesh())
    assert zs.load_checkpoint(model, zopt, f"{root}/tp1") == SAVED_AT
    _check(model, zopt, want, at_tp2, "tp 1 -> 2 at dp 2")


def test_experts_load_at_another_tensor_parallel_size(tmp_path: Path) -> None:
    run_ranks(_across_sizes, 4, str(tmp_path))
    # The tp checkpoint as a build from before `expert_split` wrote it: which instances
    # are one expert's pieces is unknown, so neither a load nor consolidation guesses.
    old = tmp_path / "unmarked"
    shutil.copytree(tmp_path / "tp2" / f"step-{SAVED_AT}", old)
    meta = CheckpointMeta.from_bytes((old / "metadata.json").read_bytes())
    groups = tuple(replace(g, expert_split=None) for g in meta.groups)
    (old / "metadata.json").write_text(replace(meta, groups=groups).to_json())
    with pytest.raises(CheckpointError, match="without expert_split"):
        load(old, rank=0, world_size=1)
    with pytest.raises(CheckpointError, match="without expert_split"):
        consolidate(old, tmp_path / "out.safetensors", instance=0)
