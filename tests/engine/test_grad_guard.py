"""torch's `clip_grad_norm_` on the engine's parameters fails loudly; the engine's clips.

At every stage, after backward, `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`
raises an error naming `optimizer.clip_grad_norm_` (it used to return 0 or a rank-local
norm, silently). Around it, training must go on exactly as without the guard: two
micro-batches accumulated per step, `model.zero_grad()` (both flavours) between steps,
and the engine's global norm and losses equal to a single-process reference.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks, subtests
from tests.engine._models import global_batches, loss_fn, make_model, make_optimizer

STEPS, ACCUM, MICRO = 3, 2, 2
CLIP = 0.05  # below the gradient norm of every step: clipping acts


def _config(stage: int) -> dict[str, object]:
    config: dict[str, object] = {"stage": stage, "reduce_bucket_bytes": 1500}
    if stage == 3:
        config.update(min_unit_params=1, persistence_threshold=0)
    return config


def _case(stage: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(seed=3)
    ref = copy.deepcopy(model)
    ref_opt = make_optimizer(ref, "sgd")
    batches = global_batches(STEPS, ACCUM, world, MICRO)
    model, opt = zs.initialize(model, make_optimizer(model, "sgd"), _config(stage))
    for s in range(STEPS):
        ref_loss = 0.0
        for a in range(ACCUM):
            loss = loss_fn(ref, batches[s, a].reshape(-1, batches.shape[-1])) / ACCUM
            loss.backward()
            ref_loss += float(loss.detach())
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP))
        ref_opt.step()
        ref_opt.zero_grad()

        ours = 0.0
        for a in range(ACCUM):
            loss = loss_fn(model, batches[s, a, rank]) / ACCUM
            loss.backward()
            ours += float(loss.detach())
        with pytest.raises(RuntimeError, match=r"optimizer\.clip_grad_norm_"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        norm = float(opt.clip_grad_norm_(CLIP))
        opt.step()
        opt.zero_grad()
        model.zero_grad(set_to_none=s % 2 == 0)
        total = torch.tensor([ours])
        dist.all_reduce(total)
        assert abs(float(total) / world - ref_loss) < 1e-5, (s, float(total) / world, ref_loss)
        assert abs(norm - ref_norm) < 1e-5 * max(1.0, ref_norm), (s, norm, ref_norm)
        assert ref_norm > CLIP
    full = zs.full_state_dict(model)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=k)


def _all() -> None:
    run_each(subtests({"stage": [1, 2, 3]}), _case)


def test_torch_clip_fails_loudly_and_training_is_unchanged() -> None:
    run_ranks(_all, 2)
