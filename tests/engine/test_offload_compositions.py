"""CPU offload composed with the other features, against a plain single-process torch run
of the same optimizers on the global batch (the same seed and data), on 2 gloo ranks.

Several optimizers (SGD with momentum on the blocks, AdamW on the rest), and torch's
Muon recipe (Muon on the hidden matrices, AdamW on the rest: Muon's momentum on the
host, each matrix orthogonalized on its owner's device): each optimizer steps its own
flat groups, those CPU offload holds on the host; at stages 2 and 3, fully and partially
offloaded (`offload_ratio`), with accumulation and clipping; a checkpoint saved in the
combination resumes bit for bit. fp32: rtol 1e-5 / atol 1e-6, as test_parity.py.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks
from tests.engine._models import global_batches, loss_fn, make_model, muon_and_adamw

STEPS = 3
MICRO = 2


def _sgd_and_adamw(model: nn.Module) -> list[torch.optim.Optimizer]:
    """SGD with momentum on the blocks, AdamW on the rest (trainable parameters only)."""
    blocks = [p for n, p in model.named_parameters() if n.startswith("blocks") and p.requires_grad]
    rest = [p for p in model.parameters() if p.requires_grad and all(p is not b for b in blocks)]
    return [
        torch.optim.SGD(blocks, lr=0.05, momentum=0.9),
        torch.optim.AdamW(rest, lr=1e-2, betas=(0.9, 0.95)),
    ]


def _config(stage: int, ratio: float) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "stage": stage,
        "reduce_dtype": "fp32",
        "offload_optimizer": True,
        "offload_ratio": ratio,
        "reduce_bucket_bytes": 1500,
    }
    if stage == 3:
        cfg.update(min_unit_params=1, persistence_threshold=0)
    return cfg


def _train(model: Any, opts: Any, batches: torch.Tensor, steps: range, clip: bool) -> None:
    """This rank's part of each global batch (all of it for the one-process reference)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    single = isinstance(opts, list)
    accum = batches.shape[1]
    for step in steps:
        flat = batches[step].reshape(-1, batches.shape[-1])
        mine = flat if single else flat.chunk(world)[rank]
        for micro in mine.reshape(accum, -1, flat.shape[-1]):
            (loss_fn(model, micro) / accum).backward()
        if clip and single:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        elif clip:
            opts.clip_grad_norm_(0.5)
        for o in opts if single else [opts]:
            o.step()
            o.zero_grad()


MAKERS = {"sgd+adamw": _sgd_and_adamw, "muon+adamw": lambda m: muon_and_adamw(m)}


def _several_optimizers(stage: int, ratio: float, accum: int, kind: str, root: str) -> None:
    make = MAKERS[kind]
    model = make_model(seed=stage)
    batches = global_batches(STEPS, accum, dist.get_world_size(), MICRO)
    ref = copy.deepcopy(model)
    _train(ref, make(ref), batches, range(STEPS), clip=True)
    model, opt = zs.initialize(model, make(model), _config(stage, ratio))
    on_host = [g for g in opt.flat_groups if g.trainable and g.home.kind is zs.HomeKind.HOST]
    held = {g.key.param_group for g in on_host}
    # Fully offloaded, both optimizers step groups on the host; partially, some at least.
    assert held == {0, 1} if ratio == 1 else bool(held), held
    _train(model, opt, batches, range(STEPS - 1), clip=True)
    path = Path(root) / f"{kind}s{stage}r{ratio}a{accum}"
    zs.save_checkpoint(model, opt, path, step=STEPS - 1)
    _train(model, opt, batches, range(STEPS - 1, STEPS), clip=True)
    full = zs.full_state_dict(model)
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(full[name], want, rtol=1e-5, atol=1e-6, msg=name)
    # The same combination resumed from the checkpoint ends with the same bits.
    again = make_model(seed=stage)
    again, opt2 = zs.initialize(again, make(again), _config(stage, ratio))
    zs.load_checkpoint(again, opt2, path)
    _train(again, opt2, batches, range(STEPS - 1, STEPS), clip=True)
    for name, value in zs.full_state_dict(again).items():
        assert torch.equal(value, full[name]), name


def _all(root: str) -> None:
    run_each(
        [
            dict(stage=stage, ratio=ratio, accum=accum, kind=kind)
            for kind in MAKERS
            for stage, ratio, accum in ((2, 1.0, 1), (3, 1.0, 2), (3, 0.5, 1))
        ],
        lambda **c: _several_optimizers(**c, root=root),
    )


def test_offload_composes(tmp_path: Path) -> None:
    run_ranks(_all, 2, str(tmp_path))
