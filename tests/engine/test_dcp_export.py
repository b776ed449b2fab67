"""A zeroshard checkpoint written as PyTorch DCP, loaded and continued by FSDP2 itself.

zeroshard (2 gloo ranks, stages 1 and 3, AdamW with two param groups) trains 2 steps,
saves with `save_checkpoint`, then trains 2 more steps on stored batches. The checkpoint
is converted (`convert_to_dcp`, and `zeroshard-ckpt to-dcp`) and FSDP2 (`fully_shard`
at worlds 1 and 3) loads it the way an FSDP2 job loads its own (`get_state_dict`,
`dcp.load`, `set_state_dict`) into a model initialised differently and an optimizer with
another lr; the torchtitan layout as torchtitan's checkpointer does (the model at the top
level, `flatten_optimizer_state_dict`, `train_state`). Its next 2 steps must match
zeroshard's continuation: losses to rtol 1e-6, weights to atol 1e-6 (fp32 on the CPU).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import zeroshard.engine as zs
from tests._dist import run_ranks
from tests.engine._dcp_model import BATCHES, GLOBAL_BATCH, SEQ, Net, optimizer, train_step
from zeroshard.ckpt import OutputExistsError, consolidate, convert_to_dcp, read_dcp_training_state
from zeroshard.ckpt._cli import main
from zeroshard.ckpt.foreign import _dcp_write


def _zeroshard_run(root: str, stage: int) -> None:
    torch.manual_seed(0)
    model = Net()
    cfg: dict[str, Any] = {"stage": stage}
    if stage == 3:
        cfg.update(min_unit_params=1, persistence_threshold=0)
    model, opt = zs.initialize(model, optimizer(model, lr=1e-2), cfg)
    batches = torch.randint(
        0, 11, (BATCHES, GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(1)
    )
    for batch in batches[:2]:
        train_step(model, opt, batch)
    zs.save_checkpoint(model, opt, f"{root}/zs{stage}", step=2)
    losses = [train_step(model, opt, batch) for batch in batches[2:]]
    weights = zs.full_state_dict(model)
    if dist.get_rank() == 0:
        torch.save(
            {"batches": batches, "losses": losses, "weights": weights}, f"{root}/ref{stage}.pt"
        )


@pytest.fixture(scope="module")
def zs_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("zs")
    run_ranks(_zeroshard_run, 2, str(root), 1)
    run_ranks(_zeroshard_run, 2, str(root), 3)
    return root


def _fsdp2_load(root: str, stage: int, layout: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ref = torch.load(f"{root}/ref{stage}.pt", weights_only=True)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(99)  # not zeroshard's seed: every weight must come from the checkpoint
    model = Net()
    for layer in (model.embed, model.fc1, model.head):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = optimizer(model, lr=1e-3)
    if layout == "fsdp2":
        msd, osd = get_state_dict(model, opt)
        state: dict[str, Any] = {"model": msd, "optimizer": osd, "step": 0}
        dcp.load(state, checkpoint_id=f"{root}/{layout}{stage}")
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=state["optimizer"])
        assert state["step"] == 2
    else:  # torchtitan's CheckpointManager: the model at the top level, flattened optimizer
        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        msd, osd = get_state_dict(model, opt, options=flat)
        state = {**msd, "optimizer": osd, "train_state": {"step": 0, "ntokens_seen": -1}}
        dcp.load(state, checkpoint_id=f"{root}/{layout}{stage}")
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=flat)
        assert state["train_state"] == {"step": 2, "ntokens_seen": 0}
    assert [(pg["lr"], pg["weight_decay"]) for pg in opt.param_groups] == [(1e-2, 0.1), (1e-2, 0.0)]
    losses = [train_step(model, opt, batch) for batch in ref["batches"][2:]]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]), rtol=1e-6, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(
            p.full_tensor(), ref["weights"][name], rtol=0, atol=1e-6, msg=name
        )
    buffer = model.get_buffer("scale")
    assert torch.equal(buffer, ref["weights"]["scale"])


def _fsdp2_load_all(root: str, runs: list[tuple[int, str]]) -> None:
    for stage, layout in runs:
        _fsdp2_load(root, stage, layout)


@pytest.mark.parametrize(
    ("world", "runs"), [(1, [(3, "fsdp2")]), (3, [(1, "fsdp2"), (3, "fsdp2"), (3, "torchtitan")])]
)
def test_fsdp2_continues_a_zeroshard_checkpoint(
    zs_root: Path, world: int, runs: list[tuple[int, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Chunks of one row: every tensor is cut, and spread over two files.
    monkeypatch.setattr(_dcp_write, "CHUNK_ELEMENTS", 1)
    for stage, layout in runs:
        out = zs_root / f"{layout}{stage}"
        if not out.exists():
            convert_to_dcp(zs_root / f"zs{stage}", out, layout=layout, workers=2)
    run_ranks(_fsdp2_load_all, world, str(zs_root), runs)


def test_chunks_are_bounded(zs_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What a worker holds at once is one chunk: none past CHUNK_ELEMENTS but a single row.
    from torch.distributed.checkpoint import FileSystemReader

    monkeypatch.setattr(_dcp_write, "CHUNK_ELEMENTS", 12)
    convert_to_dcp(zs_root / "zs1", tmp_path / "dcp", workers=3)
    meta = FileSystemReader(tmp_path / "dcp").read_metadata()
    tensors = {k: v for k, v in meta.state_dict_metadata.items() if hasattr(v, "chunks")}
    for name, entry in tensors.items():
        row = math.prod(entry.size[1:])
        assert all(math.prod(c.sizes) <= max(12, row) for c in entry.chunks), name
    assert len(tensors["model.embed.weight"].chunks) == 6  # 11 rows of 6, 2 rows a chunk
    assert len({i.relative_path for i in meta.storage_data.values()}) == 3


def test_the_command_and_a_round_trip(zs_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "dcp"
    assert main(["to-dcp", str(zs_root / "zs3"), str(out), "--step", "2"]) == 0
    assert main(["to-dcp", str(zs_root / "zs3"), str(out)]) == 1  # exists: refused
    with pytest.raises(OutputExistsError):
        convert_to_dcp(zs_root / "zs3", out)
    assert main(["to-dcp", str(zs_root / "zs3"), str(out), "--overwrite"]) == 0
    # Read back as DCP, it is the zeroshard checkpoint: weights bit for bit, the moments,
    # the hyperparameters and steps.
    consolidate(zs_root / "zs3", tmp_path / "zs.safetensors")
    consolidate(out, tmp_path / "dcp.safetensors")
    want, got = load_file(tmp_path / "zs.safetensors"), load_file(tmp_path / "dcp.safetensors")
    assert set(got) == {f"model.{k}" for k in want}
    assert all(torch.equal(got[f"model.{k}"], v) for k, v in want.items())
    titan = tmp_path / "titan" / "step-2"
    convert_to_dcp(zs_root / "zs3", titan, layout="torchtitan")
    for path in (out, titan.parent):
        named = read_dcp_training_state(path, buffers={"scale"})
        assert named.step == 2 and set(named.buffers) == {"scale"}
        assert set(named.masters) == set(want) - {"scale"}
        assert [dict(g.scalars) for g in named.param_groups] == [{"step": 2.0}] * 2
        assert [g.hyperparameters["weight_decay"] for g in named.param_groups] == [0.1, 0.0]
        assert set(named.optimizer_state) == {"exp_avg", "exp_avg_sq"}
