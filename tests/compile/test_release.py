"""A compiled model lets go of its memory once the user drops it.

World 2 on real process groups: build an engine and a compiled model, train two steps,
drop every reference, `gc.collect()`. Then nothing of the engine may survive: weakrefs
to the module, the compiled model, the optimizer, every flat group's master shard,
gathered buffer and gradient shard, and every optimizer state tensor are dead (a
census of the bytes still alive names what is left). No `torch._dynamo.reset()`: torch
keeps every backend given to `torch.compile`, so the backend must not hold the model.
Cases: fp32, bf16 without the fused downcast, and a model that falls back to eager.
CPU uses backend="aot_eager"; CUDA runs inductor, as users do.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zeroshard.compile as zc
import zeroshard.engine as zs
from tests._dist import run_each, run_ranks, world_fits
from tests.engine._models import VOCAB, loss_fn, make_model, make_optimizer

CONFIG = {"stage": 3, "min_unit_params": 1, "persistence_threshold": 0}


class Branchy(nn.Module):
    """A branch on a value: Dynamo cannot capture it, so the compiled model falls back."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        if x.sum() > 0:
            x = F.relu(x)
        return self.head(x)


def _train_and_drop(device: str, case: str) -> dict[str, weakref.ref[Any]]:
    """Train a compiled model two steps; weakrefs to everything that holds its memory."""
    config: dict[str, Any] = dict(CONFIG)
    pipeline = None
    if case == "bf16-nofuse":
        config["compute_dtype"] = "bf16"
        pipeline = zc.default_pipeline().without("fuse_downcast")
    base = Branchy() if case == "fallback" else make_model(seed=11)
    model, opt = zs.initialize(base.to(device), make_optimizer(base), config)
    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = zc.compile(model, backend=backend, pipeline=pipeline)
    gen = torch.Generator().manual_seed(dist.get_rank())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's warning is test_compiled's concern
        for _ in range(2):
            idx = torch.randint(0, VOCAB, (2, 5), generator=gen).to(device)
            loss_fn(compiled, idx).backward()
            opt.step()
    assert compiled.eager == (case == "fallback")
    state = zs.engine_state(model)
    refs: dict[str, weakref.ref[Any]] = {
        "module": weakref.ref(model),
        "compiled model": weakref.ref(compiled),
        "optimizer": weakref.ref(opt),
    }
    for g in state.groups:
        assert g.param_buffer is not None
        refs[f"group {g.index} master"] = weakref.ref(g.master)
        refs[f"group {g.index} gathered buffer"] = weakref.ref(g.param_buffer)
        if g.grad_shard is not None:
            refs[f"group {g.index} grad shard"] = weakref.ref(g.grad_shard)
    for i, per_param in enumerate(opt.inner.state.values()):
        for k, v in per_param.items():
            if isinstance(v, torch.Tensor):
                refs[f"optimizer state {i}.{k}"] = weakref.ref(v)
    assert len(refs) > 3 + 2 * len(state.groups)
    return refs


def _case(device: str, case: str) -> None:
    refs = _train_and_drop(device, case)
    gc.collect()
    alive = {name: r() for name, r in refs.items() if r() is not None}
    held = sum(t.untyped_storage().nbytes() for t in alive.values() if isinstance(t, torch.Tensor))
    assert not alive, f"{held} tensor bytes still alive after the drop: {sorted(alive)}"


@pytest.mark.gpu
def test_dropped_compiled_model_frees_engine(device: str) -> None:
    world_fits(device, 2)
    run_ranks(_cases, 2, device, device=device)


def _cases(device: str) -> None:
    run_each(
        [{"case": "fp32"}, {"case": "bf16-nofuse"}, {"case": "fallback"}],
        lambda case: _case(device, case),
    )
