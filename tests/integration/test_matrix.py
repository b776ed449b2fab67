"""The test matrix of issue 16: every ZeRO stage x dtype x eager/compiled x offload x hybrid
cell trains like a plain single-process reference.

On CUDA (`nox -s "gpu(world=N)"`, i.e. `pytest --device cuda -m gpu -k worldN`) the whole
matrix runs on NCCL at worlds 1, 2, 4 and 8: stages 1-3 x fp32/bf16/fp16 x offload off/on,
stage 3 also compiled (inductor), and each of those hybrid (shard within world / 2
ranks, replicate across 2) where the world is 4 or more. In the default suite (CPU,
gloo) a corner of it runs at world 2, so that this file is exercised on every change.

Each cell (one spawn of `world` ranks) trains the tests' odd model for 3 steps and
compares with the fp32 reference that sees the global batch: fp32 losses and final
parameters at rtol 1e-5 / atol 1e-6 (1e-4 / 1e-5 on CUDA, where TF32 and kernel choice
differ from the CPU reference); bf16 and fp16 losses at rtol 2e-2, and the total
parameter update within 10% of the reference's in norm (see tests/engine/test_parity.py
for why). Offload on: optimizer state and master weights on the CPU, and at stage 3 the
parameter shards too, except in compiled cells: the compiled graph takes every shard at
its start, which offload_params exists to avoid (`zeroshard.compile` refuses it), so a
compiled offload cell offloads the optimizer alone. Compiled cells run through
`zeroshard.compile` (aot_eager on CPU). Every compiled cell (fp16, hybrid and offload
included) must be captured, not fall back to eager; a cell whose behaviour changes fails
here, so that docs/testing.md is updated with it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks, world_fits
from tests.engine._models import global_batches, loss_fn, make_model, make_optimizer, reference_run

WORLDS = (1, 2, 4, 8)
STEPS = 3
MICRO = 2


@dataclass(frozen=True)
class Cell:
    """One configuration of the matrix."""

    world: int
    stage: int
    dtype: str  # "fp32" | "bf16" | "fp16"
    compiled: bool
    offload: bool
    hybrid: bool

    @property
    def name(self) -> str:
        """The pytest id, e.g. `world4-zs3-bf16-compiled-offload-hybrid`."""
        parts = [f"world{self.world}", f"zs{self.stage}", self.dtype]
        parts.append("compiled" if self.compiled else "eager")
        parts += ["offload"] if self.offload else []
        parts += ["hybrid"] if self.hybrid else []
        return "-".join(parts)


def matrix(world: int) -> list[Cell]:
    """Every cell of the matrix at `world` ranks."""
    hybrids = (False, True) if world >= 4 else (False,)
    return [
        Cell(world, stage, dtype, compiled, offload, hybrid)
        for stage in (1, 2, 3)
        for dtype in ("fp32", "bf16", "fp16")
        for compiled in ((False, True) if stage == 3 else (False,))
        for offload in (False, True)
        for hybrid in hybrids
    ]


# The CPU corner (default suite, gloo, world 2): every stage, every dtype, offload both
# ways, compiled cells captured (fp32, fp16, and bf16 with offload).
CORNER = (
    Cell(2, 1, "fp16", False, True, False),
    Cell(2, 2, "bf16", False, True, False),
    Cell(2, 3, "fp32", True, False, False),
    Cell(2, 3, "bf16", True, True, False),
    Cell(2, 3, "fp16", True, False, False),
)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """On CUDA every cell alone (one result each); on CPU the corner in one spawn, since
    starting ranks costs more than a cell on 2 shared cores."""
    if "cells" in metafunc.fixturenames:
        if metafunc.config.getoption("--device") == "cuda":
            groups: list[tuple[Cell, ...]] = [(c,) for w in WORLDS for c in matrix(w)]
            ids = [c.name for (c,) in groups]
        else:
            groups, ids = [CORNER], ["world2-corner"]
        metafunc.parametrize("cells", groups, ids=ids)


def _config(cell: Cell) -> dict[str, Any]:
    config: dict[str, Any] = {
        "stage": cell.stage,
        "compute_dtype": cell.dtype,
        "reduce_dtype": "fp32",
        # Small buckets: several reductions and gathers in flight, as on a big model.
        "reduce_bucket_bytes": 1500,
        "allgather_bucket_bytes": 1000,
    }
    if cell.dtype == "fp16":
        config["initial_loss_scale"] = 1024.0  # no overflow-skipped step on this model
    if cell.stage == 3:
        config.update(min_unit_params=1, persistence_threshold=0)
    if cell.offload:
        config.update(offload_optimizer=True, offload_chunk_bytes=1000)
        if cell.stage == 3 and not cell.compiled:
            config["offload_params"] = True
    if cell.hybrid:
        config["shard_group_size"] = cell.world // 2
    return config


def _cell(device: str, cell: Cell) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model(seed=cell.stage)
    batches = global_batches(STEPS, 1, world, MICRO)
    ref_losses, _, ref_state = reference_run(model, make_optimizer, batches, None)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.to(device)
    engine, opt = zs.initialize(model, make_optimizer(model), _config(cell))
    forward: Any = engine
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cell.compiled:
            import zeroshard.compile as zc

            backend = "inductor" if device == "cuda" else "aot_eager"
            forward = zc.compile(engine, backend=backend)
        for step in range(STEPS):
            loss = loss_fn(forward, batches[step, 0, rank].to(device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            total = loss.detach().reshape(1).float()
            dist.all_reduce(total)
            losses.append(float(total) / world)
    if cell.compiled:
        fallbacks = [str(w.message) for w in caught if "zeroshard.compile" in str(w.message)]
        assert not forward.eager, f"{cell.name}: expected capture, got a fallback: {fallbacks}"
    lowp = cell.dtype != "fp32"
    rtol, atol = (2e-2, 1e-2) if lowp else ((1e-4, 1e-5) if device == "cuda" else (1e-5, 1e-6))
    torch.testing.assert_close(losses, ref_losses, rtol=rtol, atol=atol)
    full = zs.full_state_dict(engine)
    assert full.keys() == ref_state.keys()
    if not lowp:
        for name, ref in ref_state.items():
            torch.testing.assert_close(full[name].cpu(), ref, rtol=rtol, atol=atol, msg=name)
        return
    trained = [k for k in initial if k not in ("frozen.weight", "frozen.bias", "offset")]
    ours = torch.cat([(full[k].cpu() - initial[k]).reshape(-1) for k in trained])
    theirs = torch.cat([(ref_state[k] - initial[k]).reshape(-1) for k in trained])
    err = float((ours - theirs).norm() / theirs.norm())
    assert err < 0.10, f"{cell.name}: the update differs from the reference's by {err:.1%}"


def _cells(device: str, cells: tuple[Cell, ...]) -> None:
    run_each([{"cell": c} for c in cells], lambda cell: _cell(device, cell))


@pytest.mark.gpu
def test_matrix(cells: tuple[Cell, ...], device: str) -> None:
    world = cells[0].world
    world_fits(device, world)
    run_ranks(_cells, world, device, cells, device=device, timeout_s=300 * len(cells))
