"""A checkpoint loaded into a run whose one optimizer declares `zeroshard_whole_params`.

Its masters are in no param group (the declared optimizer steps the whole parameters
`WholeMatrices` makes), so the load must not give them optimizer state: torch's
`state_dict()` raised KeyError after such a load. On 2 gloo ranks at stages 2 and 3:
save after one step, load into a fresh engine, `state_dict()` works and the next two
steps equal the uninterrupted run's to the bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zeroshard.engine as zs
from tests._dist import run_ranks
from tests.engine._models import make_model
from tests.faults._engine import assert_same_bits, train_step


class WholeAdamW(torch.optim.AdamW):
    """AdamW stepped on whole parameters at their owners, through the declaration."""

    zeroshard_whole_params = True


def _engine(stage: int) -> tuple[torch.nn.Module, zs.ZeroOptimizer]:
    model = make_model(11)
    cfg = {"stage": stage, "min_unit_params": 1, "persistence_threshold": 0}
    return zs.initialize(model, WholeAdamW(model.parameters(), lr=1e-2), cfg)


def _body(root: str) -> None:
    for stage in (2, 3):
        path = Path(root) / f"stage{stage}"
        model, opt = _engine(stage)
        train_step(model, opt, 0)
        zs.save_checkpoint(model, opt, path, step=1)
        for step in (1, 2):
            train_step(model, opt, step)
        want = zs.full_state_dict(model)

        model, opt = _engine(stage)
        zs.load_checkpoint(model, opt, path)
        saved = opt.state_dict()
        assert saved["inner"]["state"], "the whole parameters' state was not loaded"
        for step in (1, 2):
            train_step(model, opt, step)
        assert_same_bits(zs.full_state_dict(model), want)
        dist.barrier()


def test_declared_whole_params_optimizer_resumes(tmp_path: pytest.TempPathFactory) -> None:
    run_ranks(_body, 2, str(tmp_path))
