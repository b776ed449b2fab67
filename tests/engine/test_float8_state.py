"""Checkpoints of a model whose weights zeroshard gathers in fp8 (torchao, stage 3, bf16).

They hold plain weights under the modules' own names (no torchao name or subclass),
consolidate without model code to safetensors that load, strictly, into the model never
converted, and resume bit for bit: a fresh engine loaded from the checkpoint takes the
same steps as the run that saved it, to the last bit of losses and weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import zeroshard.engine as zs
from tests._dist import run_ranks, world_fits
from tests.engine._float8 import Net, batches, make_net, make_optimizer, train
from zeroshard.ckpt import consolidate

CONFIG = {"stage": 3, "compute_dtype": "bf16", "min_unit_params": 1, "persistence_threshold": 0}


def _engine(seed: int, device: str) -> tuple[torch.nn.Module, zs.ZeroOptimizer]:
    net = make_net(seed, "tensorwise", True, device)
    return zs.initialize(net, make_optimizer(net), CONFIG)


def _save_and_resume(root: str, device: str) -> None:
    data = batches(4, 1, dist.get_world_size())
    model, opt = _engine(3, device)
    train(model, opt, data[:2], 0.5, opt.clip_grad_norm_, device)
    zs.save_checkpoint(model, opt, root, step=2)
    saved = zs.full_state_dict(model)
    after = train(model, opt, data[2:], 0.5, opt.clip_grad_norm_, device)
    final = zs.full_state_dict(model)
    # Another seed: nothing but the checkpoint can make the weights equal.
    model, opt = _engine(4, device)
    assert zs.load_checkpoint(model, opt, root) == 2
    again = train(model, opt, data[2:], 0.5, opt.clip_grad_norm_, device)
    assert again == after
    resumed = zs.full_state_dict(model)
    for name, value in final.items():
        assert torch.equal(resumed[name], value), name
    if dist.get_rank() == 0:
        save_file(saved, f"{root}/saved.safetensors")


@pytest.mark.gpu
def test_float8_checkpoint(tmp_path: Path, device: str) -> None:
    pytest.importorskip("torchao")
    world_fits(device, 2)
    root = tmp_path / "ckpt"
    run_ranks(_save_and_resume, 2, str(root), device, device=device)
    out = tmp_path / "hf"
    consolidate(root / "step-2", out)
    merged: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        merged.update(load_file(str(f)))
    plain = Net()  # never converted: nn.Linear where the model had Float8Linear
    assert sorted(merged) == sorted(plain.state_dict())
    plain.load_state_dict(merged, strict=True)
    saved = load_file(str(root / "saved.safetensors"))
    for name, value in merged.items():
        assert type(value) is torch.Tensor and torch.equal(value, saved[name]), name
