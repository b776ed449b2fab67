"""A second process loads what the first compiled (inductor's caches), unless a pass is
the user's own.

Three fresh processes (world 2 each, real process groups) share one empty inductor cache
directory and compile the same model with inductor: the first misses AOTAutograd's cache
and saves; the second hits it (and inductor's FX-graph cache for forward and backward),
and its losses over two steps equal the first's exactly (each rank has an entry of its own:
the rank is part of the key); the third, whose pipeline has a pass of its own, bypasses
the cache (its code and state cannot be named in a key) and still matches. Nobody
recompiles after the first step. In one process, a model compiled after an earlier one
was dropped loads that one's graphs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import fx

import zeroshard.compile as zc
import zeroshard.engine as zs
from tests._dist import run_ranks, world_fits
from tests.engine._models import global_batches, loss_fn, make_model, make_optimizer

CONFIG = {"stage": 3, "min_unit_params": 1, "persistence_threshold": 0}


def _own_pass(graph: fx.Graph, context: zc.PassContext) -> None:
    """A pass from outside zeroshard.compile (it does nothing, but nobody can tell)."""


def _run(device: str, out: str, own_pass: bool) -> None:
    from torch._dynamo.utils import counters

    base = make_model(seed=11).to(device)
    model, opt = zs.initialize(base, make_optimizer(base), CONFIG)
    pipeline = zc.default_pipeline()
    if own_pass:
        pipeline = pipeline.append(_own_pass, {zc.Phase.BACKWARD})
    compiled = zc.compile(model, pipeline=pipeline)
    batches = global_batches(2, 1, dist.get_world_size(), 2)
    losses = []
    for step in range(2):
        loss = loss_fn(compiled, batches[step, 0, dist.get_rank()].to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    assert not compiled.eager and compiled.compiles == 1
    if dist.get_rank() == 0:
        seen = {**counters["aot_autograd"], **counters["inductor"]}
        keys = ("autograd_cache_", "fxgraph_cache_")
        found = {k: v for k, v in seen.items() if k.startswith(keys)}
        Path(out).write_text(json.dumps({"losses": losses, "cache": found}))


@pytest.mark.gpu
def test_second_process_loads_the_compiled_graphs(
    device: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    world_fits(device, 2)
    # Spawned ranks inherit the environment: one fresh cache shared by the three runs.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    runs = []
    for i, own_pass in enumerate([False, False, True]):
        out = tmp_path / f"run{i}.json"
        run_ranks(_run, 2, device, str(out), own_pass, device=device, timeout_s=600)
        runs.append(json.loads(out.read_text()))
        if i == 0:
            # One entry per rank: each rank's code writes its own part of the in-place
            # collectives' buffers, so a rank must never load another's.
            entries = list((tmp_path / "inductor" / "aotautograd").iterdir())
            assert len(entries) == 2, entries
    first, second, own = (r["cache"] for r in runs)
    assert first.get("autograd_cache_miss") == 1 and first.get("autograd_cache_saved") == 1, first
    assert second.get("autograd_cache_hit") == 1 and not second.get("autograd_cache_miss"), second
    assert second.get("fxgraph_cache_hit") == 2, second
    assert own.get("autograd_cache_bypass") == 1 and not own.get("autograd_cache_hit"), own
    assert runs[1]["losses"] == runs[0]["losses"]
    torch.testing.assert_close(runs[2]["losses"], runs[0]["losses"], rtol=0, atol=0)


def _twice(device: str) -> None:
    import gc

    from torch._dynamo.utils import counters

    seen = []
    for _ in range(2):
        base = make_model(seed=11).to(device)
        model, opt = zs.initialize(base, make_optimizer(base), CONFIG)
        compiled = zc.compile(model)
        batch = global_batches(1, 1, dist.get_world_size(), 2)[0, 0, dist.get_rank()]
        loss_fn(compiled, batch.to(device)).backward()
        opt.step()
        seen.append(dict(counters["aot_autograd"]))
        del compiled, model, opt, base
        gc.collect()
    first, second = seen
    assert first.get("autograd_cache_miss") == 1, first
    # The second model got the keys the dropped one had: the same graph, a cache hit.
    assert second.get("autograd_cache_hit") == 1, second
    assert second.get("autograd_cache_miss") == 1, second  # the first model's, counted once


@pytest.mark.gpu
def test_a_model_compiled_after_a_dropped_one_loads_its_graphs(
    device: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second compiled model in one process, the first one dropped, loads what the first
    compiled (the ops' keys in the graph are given again once their model is gone)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    run_ranks(_twice, 1, device, device=device, timeout_s=600)
