"""State under tensor parallelism: full state dicts, checkpoints across shapes, export.

A dp 2 x tp 2 run (stage 3, sequence parallelism) trains two steps and saves; then:
the same shape resumes bit for bit; `model.state_dict()` holds DTensors whose whole
tensors are `full_state_dict`'s, and `load_state_dict` of the whole tensors or
`load_safetensors` of the consolidated file give the same weights back; the checkpoint
loads at dp 4 without tensor parallelism (stages 1 and 3), at dp 1 x tp 2 and in one
process, and one more step from there matches the 2 x 2 run's (fp32, rtol 1e-5); and
`gathered_parameters` shows each rank's pieces whole over dp (edits refused);
`zeroshard-ckpt consolidate` writes the unsplit model's names, shapes and dtypes with the
values `full_state_dict` had, bit for bit. The planner's `--tp` model states (masters and
AdamW state per rank) are the engine's, to the byte.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import zeroshard.engine as zs
from tests._dist import run_ranks
from tests.engine import _tp
from tests.engine.test_tensor_parallel import engine_config

SEED = 5


def _global_batch(step: int) -> torch.Tensor:
    return _tp.batches(3, 1, 2)[step].reshape(-1, _tp.SEQ + 1)


def _train(model: Any, opt: Any, steps: range, dp: int, dp_rank: int) -> None:
    for step in steps:
        _tp.loss_fn(model, _global_batch(step).chunk(dp)[dp_rank]).backward()
        opt.step()
        opt.zero_grad()


def _split(mesh: Any, stage: int = 3) -> tuple[Any, Any]:
    model, _ = _tp.split_model(mesh, sp=True, seed=SEED)
    opt = _tp.make_optimizer(model)
    return zs.initialize(model, opt, engine_config(stage, "fp32"), device_mesh=mesh)


def _unsplit(stage: int) -> tuple[Any, Any]:
    torch.manual_seed(SEED)
    model = _tp.TPModel()
    return zs.initialize(model, _tp.make_optimizer(model), engine_config(stage, "fp32"))


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k}"


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=f"{what}: {k}")


def _planned_states_match(model: Any) -> None:
    state = zs.engine_state(model)
    plan = _tp.plan(state.config, sp=True)
    shards = sum(g.master.numel() for g in state.groups)
    assert plan.states["master"] == 4 * shards, (plan.states, shards)
    assert plan.states["optimizer"] == 8 * shards, (plan.states, shards)


def _save_and_reload(root: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    model, opt = _split(mesh)
    _planned_states_match(model)
    _train(model, opt, range(2), 2, dp_rank)
    zs.save_checkpoint(model, opt, root, step=2)
    saved = zs.full_state_dict(model)
    # model.state_dict(): DTensors (as before initialize), whole as full_state_dict's.
    sd = model.state_dict()
    assert isinstance(sd["blocks.0.up.weight"], DTensor)
    _equal(
        {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd.items()}, saved, "sd"
    )
    # gathered_parameters: each rank's pieces whole over dp, DTensors still; no edits.
    with zs.gathered_parameters(model):
        weight = model.blocks[0].up.weight
        assert isinstance(weight, DTensor)
        assert torch.equal(weight.full_tensor(), saved["blocks.0.up.weight"])
    edits = zs.gathered_parameters(model, modifier_rank=0)
    with pytest.raises(ValueError, match=r"modifier_rank .* not supported under tensor"), edits:
        pass
    _train(model, opt, range(2, 3), 2, dp_rank)
    after = zs.full_state_dict(model)

    again, opt2 = _split(mesh)
    assert zs.load_checkpoint(again, opt2, root) == 2
    _equal(zs.full_state_dict(again), saved, "loaded at 2 x 2")
    _train(again, opt2, range(2, 3), 2, dp_rank)
    _equal(zs.full_state_dict(again), after, "resumed at 2 x 2")

    by_dict, _ = _split(mesh)
    by_dict.load_state_dict(saved)  # whole tensors: each rank takes its piece
    _equal(zs.full_state_dict(by_dict), saved, "load_state_dict of whole tensors")

    for stage in (1, 3):  # dp 4, no tensor parallelism
        plain, plain_opt = _unsplit(stage)
        zs.load_checkpoint(plain, plain_opt, root)
        _equal(zs.full_state_dict(plain), saved, f"loaded at 4 x 1, stage {stage}")
        _train(plain, plain_opt, range(2, 3), 4, dist.get_rank())
        _close(zs.full_state_dict(plain), after, f"a step at 4 x 1, stage {stage}")

    exported = Path(out) / "tp.safetensors"
    if dist.get_rank() == 0:
        from zeroshard.ckpt._cli import main as ckpt_cli

        ckpt_cli(["consolidate", str(Path(root) / "step-2"), str(exported)])
        torch.save({"saved": saved, "after": after}, Path(out) / "expected.pt")
        meta = json.loads((Path(root) / "step-2" / "metadata.json").read_text())
        assert meta["version"] == 6  # the optimizers recorded
        dims = {k: v for g in meta["groups"] for k, v in g["tensor_split"]["dims"].items()}
        assert dims["blocks.0.up.weight"] == 0 and dims["blocks.0.down.weight"] == 1, dims
        assert dims["emb.weight"] == 0 and "blocks.0.norm.weight" not in dims, dims
    dist.barrier()
    loaded, _ = _split(mesh)
    zs.load_safetensors(loaded, exported)
    _equal(zs.full_state_dict(loaded), saved, "load_safetensors of the consolidated file")


def _load_elsewhere(root: str, out: str, dp: int, tp: int) -> None:
    expected = torch.load(Path(out) / "expected.pt")
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        model, opt = _split(mesh, stage=2)
        dp_rank = mesh.get_local_rank("dp")
    else:
        model, opt = _unsplit(stage=2)
        dp_rank = dist.get_rank()
    zs.load_checkpoint(model, opt, root)
    _equal(zs.full_state_dict(model), expected["saved"], f"loaded at {dp} x {tp}")
    _train(model, opt, range(2, 3), dp, dp_rank)
    _close(zs.full_state_dict(model), expected["after"], f"a step at {dp} x {tp}")


def test_tensor_parallel_checkpoints(tmp_path: Path) -> None:
    root, out = str(tmp_path / "ckpt"), str(tmp_path)
    run_ranks(_save_and_reload, 4, root, out)
    run_ranks(_load_elsewhere, 2, root, out, 1, 2)
    run_ranks(_load_elsewhere, 1, root, out, 1, 1)
    # The export is the unsplit model's file: its names, shapes and dtypes, and the values
    # the 2 x 2 run's full_state_dict had.
    torch.manual_seed(SEED)
    unsplit = tmp_path / "unsplit.safetensors"
    save_file(_tp.TPModel().state_dict(), unsplit)
    exported = tmp_path / "tp.safetensors"

    def header(path: Path) -> dict[str, tuple[Any, ...]]:
        with safe_open(path, "pt") as f:
            return {
                k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape()))
                for k in f.keys()  # noqa: SIM118 (safe_open is no dict)
            }

    assert header(exported) == header(unsplit)
    saved = torch.load(tmp_path / "expected.pt")["saved"]
    _equal(load_file(exported), saved, "consolidated")
