"""CPU offload's schedules of the host step with several optimizers, on 2 gloo ranks.

`step_in_backward` steps each offloaded group as its gradient lands and
`delay_param_update` steps them on the stepping thread beside the next window; with
several optimizers each group is stepped by the optimizer that owns it, every
optimizer's groups in one upload round (small chunks here, so a chunk holds groups of
both). Each element's update is the same float operations as in the step without the
schedule, so the weights and the optimizer state are those of that step bit for bit
(step_in_backward), or of that step with the lag applied by hand (delay_param_update:
after each step the parameters are set back to the weights the step before published, as
test_offload_delayed.py's reference). The step without the schedule is checked against a
single-process torch run in test_offload_compositions.py. A checkpoint saved in the
combination resumes to the same bits as the run it was saved from (step_in_backward), or
as the plain step resumed with the lag by hand from the same checkpoint (a load publishes
what it loaded, so the resumed run's first window is not lagged).

Beside a whole-matrix optimizer (Muon, whose step of a group is a collective: [Note:
whole-matrix steps are collectives] in whole/_exchange.py) the delayed step steps the
other optimizers' groups on its thread and Muon's at step(), all published a step later:
the plain step lagged by hand, bit for bit, resumed too; under step_in_backward Muon's
matrices step at step(), the others' offloaded groups in backward (Muon alone refuses it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks
from tests.engine._models import global_batches, loss_fn, make_model, muon_and_adamw
from tests.engine._offload_train import Trained, train_and_collect

STEPS = 3
MICRO = 2


def _blocks_and_rest(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    blocks = [p for n, p in model.named_parameters() if n.startswith("blocks") and p.requires_grad]
    rest = [p for p in model.parameters() if p.requires_grad and all(p is not b for b in blocks)]
    return blocks, rest


def _sgd_and_adamw(model: nn.Module) -> list[torch.optim.Optimizer]:
    """Per-element optimizers of two kinds (what step_in_backward steps group by group)."""
    blocks, rest = _blocks_and_rest(model)
    return [
        torch.optim.SGD(blocks, lr=0.05, momentum=0.9),
        torch.optim.AdamW(rest, lr=1e-2, betas=(0.9, 0.95)),
    ]


def _adam_and_adamw(model: nn.Module) -> list[torch.optim.Optimizer]:
    """torch's fused Adam and AdamW (what the delayed step snapshots), their own
    hyperparameters each."""
    blocks, rest = _blocks_and_rest(model)
    return [
        torch.optim.Adam(blocks, lr=3e-3, betas=(0.8, 0.99), fused=True),
        torch.optim.AdamW(rest, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.05, fused=True),
    ]


def _muon_and_fused_adamw(model: nn.Module) -> list[torch.optim.Optimizer]:
    """torch's Muon recipe with its AdamW fused (what the delayed step snapshots)."""
    muon, adamw = muon_and_adamw(model)
    rest = adamw.param_groups[0]["params"]
    return [muon, torch.optim.AdamW(rest, lr=1e-3, betas=(0.9, 0.95), fused=True)]


def _config(stage: int, ratio: float, dtype: str, delayed: bool) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "stage": stage,
        "compute_dtype": dtype,
        "reduce_bucket_bytes": 1500,
        "offload_optimizer": True,
        "offload_ratio": ratio,
        "offload_chunk_bytes": 1000,  # groups straddle chunks, both optimizers' in one
        "offload_delay_param_update": delayed,
    }
    if stage == 3:
        cfg.update(min_unit_params=1, persistence_threshold=0)
    return cfg


def _run(
    make: Any,
    cfg: dict[str, Any],
    steps: range,
    accum: int,
    *,
    early: bool = False,
    lag_by_hand: bool = False,
    clip: float | None = None,
    save: Path | None = None,
    load: Path | None = None,
) -> Trained:
    """Losses, weights and each flat group's optimizer state after `steps`: the last
    micro-batch's backward under step_in_backward if `early`; the plain step's parameters
    set back one step after each if `lag_by_hand`; saved after the first step to `save`,
    or started from `load`."""
    model = make_model(seed=cfg["stage"])
    model, opt = zs.initialize(model, make(model), cfg)
    held = {g.key.param_group for g in opt.flat_groups if g.home.kind is zs.HomeKind.HOST}
    # Fully offloaded, both optimizers step groups on the host; partially, some at least.
    assert held == {0, 1} if cfg["offload_ratio"] == 1 else bool(held), held
    if load is not None:
        zs.load_checkpoint(model, opt, load)
    return train_and_collect(
        model,
        opt,
        steps=steps,
        accum=accum,
        micro=MICRO,
        early=early,
        clip=clip,
        lag=lag_by_hand,
        save=save,
    )


def _same(ours: Trained, ref: Trained, what: str) -> None:
    assert ours[0] == ref[0], (what, ours[0], ref[0])
    torch.testing.assert_close(ours[1], ref[1], rtol=0, atol=0, msg=what)
    torch.testing.assert_close(ours[2], ref[2], rtol=0, atol=0, msg=what)


def _in_backward_case(stage: int, ratio: float, accum: int, muon: bool, root: str) -> None:
    cfg = _config(stage, ratio, "bf16", delayed=False)
    what = f"step_in_backward stage {stage} ratio {ratio} accum {accum} muon {muon}"
    path = Path(root) / f"early{stage}{ratio}{accum}{muon}"
    make = muon_and_adamw if muon else _sgd_and_adamw
    ours = _run(make, cfg, range(STEPS), accum, early=True, save=path)
    ref = _run(make, cfg, range(STEPS), accum)
    _same(ours, ref, what)
    # Resumed in the combination from the checkpoint saved after step 1.
    resumed = _run(make, cfg, range(1, STEPS), accum, early=True, load=path)
    _same(resumed, Trained(ours.losses[1:], ours.weights, ours.state), what + " resumed")


def _delayed_case(stage: int, ratio: float, accum: int, muon: bool, root: str) -> None:
    plain = _config(stage, ratio, "bf16", delayed=False)
    delayed = _config(stage, ratio, "bf16", delayed=True)
    what = f"delay_param_update stage {stage} ratio {ratio} accum {accum} muon {muon}"
    path = Path(root) / f"delayed{stage}{ratio}{accum}{muon}"
    make, clip = _muon_and_fused_adamw if muon else _adam_and_adamw, 0.05
    ours = _run(make, delayed, range(STEPS), accum, clip=clip, save=path)
    ref = _run(make, plain, range(STEPS), accum, clip=clip, lag_by_hand=True)
    _same(ours, ref, what)
    # Resumed from the checkpoint the delayed run saved (after waiting for its step in
    # flight), each way.
    ours = _run(make, delayed, range(1, STEPS), accum, clip=clip, load=path)
    ref = _run(make, plain, range(1, STEPS), accum, clip=clip, lag_by_hand=True, load=path)
    _same(ours, ref, what + " resumed")


def _several(root: str) -> None:
    cases = [
        dict(stage=2, ratio=1.0, accum=1, muon=False),
        dict(stage=3, ratio=0.5, accum=2, muon=False),
        # Muon's matrices step at step(), AdamW's offloaded groups in backward.
        dict(stage=3, ratio=1.0, accum=1, muon=True),
    ]
    run_each(cases, lambda **c: _in_backward_case(**c, root=root))
    cases = [
        dict(stage=1, ratio=1.0, accum=1, muon=False),
        dict(stage=2, ratio=0.5, accum=2, muon=False),
        dict(stage=2, ratio=1.0, accum=2, muon=True),
    ]
    run_each(cases, lambda **c: _delayed_case(**c, root=root))


def test_several_optimizers_schedules(tmp_path: Path) -> None:
    """step_in_backward and delay_param_update with SGD + AdamW / Adam + AdamW, each group
    stepped by its own optimizer, and both with Muon + AdamW: the step without the
    schedule's bits (lagged by hand where delayed), resumed too."""
    run_ranks(_several, 2, str(tmp_path))


def _muon_refusals() -> None:
    model = make_model(seed=1)
    # Muon alone (the rest frozen): nothing would step in backward.
    muon, adamw = muon_and_adamw(model)
    for p in adamw.param_groups[0]["params"]:
        p.requires_grad_(False)
    model, opt = zs.initialize(model, muon, _config(2, 1.0, "fp32", False))
    refused = r"step_in_backward\(\): a whole-matrix .* collective"
    with pytest.raises(ValueError, match=refused), opt.step_in_backward():
        pass
    # Refused on entry: the next backward and step are the plain ones.
    loss_fn(model, global_batches(1, 1, 2, MICRO)[0, 0, dist.get_rank()]).backward()
    opt.step()


def test_whole_matrix_step_in_backward_refused() -> None:
    """Muon alone under step_in_backward: a ValueError naming why on every rank."""
    run_ranks(_muon_refusals, 2)
