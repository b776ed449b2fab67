"""Resume an FSDP2 run's DCP checkpoint in zeroshard, against FSDP2's own continuation.

FSDP2 itself (`fully_shard` on 2 gloo ranks, AdamW with two param groups) trains 2 steps
and saves with `get_state_dict` + `dcp.save`, in two layouts: the plain one
(`{"model": ..., "optimizer": ..., "step": 2}`) and torchtitan's (the model at the top
level, the optimizer flattened, `train_state` and `lr_scheduler` beside it, under
`step-2/` of a root); then it trains 2 more steps on stored batches. zeroshard loads
either checkpoint into a model initialised differently (and an optimizer with another
lr) at worlds 2 and 3 and stages 1-3, trains the same 2 steps on the same global batches and
must agree with FSDP2: losses to rtol 1e-6 and weights to atol 1e-6 (fp32 on the CPU).
A model-only checkpoint loads its weights bit for bit, the optimizer afresh, and so does
either checkpoint into a model initialized without an optimizer (for evaluation).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zeroshard.engine as zs
from tests._dist import run_ranks
from tests.engine._dcp_model import BATCHES, GLOBAL_BATCH, SEQ, Net, optimizer, train_step


def _fsdp2_run(root: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = Net()
    for layer in (model.embed, model.fc1, model.head):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = optimizer(model, lr=1e-2)
    batches = torch.randint(
        0, 11, (BATCHES, GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(1)
    )
    for batch in batches[:2]:
        train_step(model, opt, batch)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd, "step": 2}, checkpoint_id=f"{root}/fsdp2")
    dcp.save({"model": msd}, checkpoint_id=f"{root}/model_only")
    saved = {n: p.full_tensor() for n, p in model.named_parameters()}
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    msd, osd = get_state_dict(model, opt, options=flat)
    titan = {
        **msd,
        "optimizer": osd,
        "train_state": {"step": 2, "ntokens_seen": 2 * GLOBAL_BATCH * SEQ},
        "lr_scheduler": {"last_epoch": 2},
    }
    dcp.save(titan, checkpoint_id=f"{root}/titan/step-2")
    losses = [train_step(model, opt, batch) for batch in batches[2:]]
    weights = {n: p.full_tensor() for n, p in model.named_parameters()}
    if dist.get_rank() == 0:
        ref = {"batches": batches, "losses": losses, "weights": weights, "saved": saved}
        torch.save(ref, f"{root}/ref.pt")


@pytest.fixture(scope="module")
def fsdp2_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fsdp2")
    run_ranks(_fsdp2_run, 2, str(root))
    return root


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _resume(root: str, source: str, stage: int) -> None:
    ref = torch.load(f"{root}/ref.pt", weights_only=True)
    torch.manual_seed(99)  # not FSDP2's seed: every weight must come from the checkpoint
    model = Net()
    cfg: dict[str, Any] = {"stage": stage}
    if stage == 3:
        cfg.update(min_unit_params=1, persistence_threshold=0)
    model, opt = zs.initialize(model, optimizer(model, lr=1e-3), cfg)
    records = _Records()
    logging.getLogger("zeroshard.engine").addHandler(records)
    logging.getLogger("zeroshard.engine").setLevel(logging.INFO)
    try:
        assert zs.load_checkpoint(model, opt, Path(root) / source) == 2
    finally:
        logging.getLogger("zeroshard.engine").removeHandler(records)
    assert all(pg["lr"] == 1e-2 for pg in opt.param_groups), "lr comes from the checkpoint"
    assert [pg["weight_decay"] for pg in opt.param_groups] == [0.1, 0.0]
    for g in zs.engine_state(model).groups:
        assert float(opt.inner.state[g.master]["step"]) == 2.0, "Adam's step"
    if dist.get_rank() == 0 and source.startswith("titan"):
        text = "\n".join(records.messages)
        assert "'lr_scheduler'" in text and "not carried over" in text, text
    losses = [train_step(model, opt, batch) for batch in ref["batches"][2:]]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]), rtol=1e-6, atol=0)
    got = zs.full_state_dict(model)
    for name, want in ref["weights"].items():
        torch.testing.assert_close(got[name], want, rtol=0, atol=1e-6, msg=name)


def _model_only(root: str, stage: int) -> None:
    # Weights only (torchtitan's last_save_model_only): step 0, the optimizer afresh.
    ref = torch.load(f"{root}/ref.pt", weights_only=True)
    model = Net()
    model, opt = zs.initialize(model, optimizer(model, lr=1e-3), {"stage": stage})
    assert zs.load_checkpoint(model, opt, Path(root) / "model_only") == 0
    assert all(pg["lr"] == 1e-3 for pg in opt.param_groups)
    assert not any(opt.inner.state[g.master] for g in zs.engine_state(model).groups)
    got = zs.full_state_dict(model)
    assert all(torch.equal(got[n], want) for n, want in ref["saved"].items())


def _evaluation(root: str, source: str, stage: int) -> None:
    # A model initialized without an optimizer loads the weights alone, bit for bit.
    ref = torch.load(f"{root}/ref.pt", weights_only=True)
    model, _ = zs.initialize(Net(), None, {"stage": stage})
    assert zs.load_checkpoint(model, None, Path(root) / source) == 2
    got = zs.full_state_dict(model)
    assert all(torch.equal(got[n], want) for n, want in ref["saved"].items())


def _resume_all(root: str, runs: list[tuple[str, int]]) -> None:
    for source, stage in runs:
        if source == "model_only":
            _model_only(root, stage)
        elif source.startswith("eval:"):
            _evaluation(root, source.removeprefix("eval:"), stage)
        else:
            _resume(root, source, stage)


@pytest.mark.parametrize(
    ("world", "runs"),
    [
        (2, [("fsdp2", 1), ("fsdp2", 2), ("fsdp2", 3), ("titan", 3), ("model_only", 2)]),
        (3, [("fsdp2", 3), ("titan/step-2", 2), ("eval:fsdp2", 3), ("eval:titan", 1)]),
    ],
)
def test_resume_matches_fsdp2(fsdp2_root: Path, world: int, runs: list[tuple[str, int]]) -> None:
    # `titan` is torchtitan's root of `step-N` checkpoints (the newest is taken).
    run_ranks(_resume_all, world, str(fsdp2_root), runs)
