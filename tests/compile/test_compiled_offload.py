"""`zeroshard.compile` of a stage-3 model whose optimizer CPU offload holds on the host
([Note: host groups in the graph]), on 2 gloo ranks.

fp32: the compiled run matches the plain single-process reference on the global batch
(rtol 1e-5 / atol 1e-6, as test_compiled.py) and the eager offloaded run, fully and
partially offloaded (`offload_ratio` 0.5: device and host groups in one graph), with
accumulation and clipping, captured once; a checkpoint saved in the combination resumes
bit for bit. bf16 compute with bf16 and fp32 gradient reduction: the compiled run is the
eager one to the last bit (aot_eager: the same ops). offload_params is refused by name.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zeroshard.compile as zc
import zeroshard.engine as zs
from tests._dist import run_each, run_ranks
from tests.compile.test_compiled import CONFIG, _train
from tests.engine._models import global_batches, make_model, make_optimizer, reference_run

STEPS = 3
MICRO = 2


def _config(ratio: float, **extra: Any) -> dict[str, Any]:
    return {**CONFIG, "offload_optimizer": True, "offload_ratio": ratio, **extra}


def _fp32_case(ratio: float, root: str) -> None:
    world = dist.get_world_size()
    base = make_model(seed=7)
    batches = global_batches(STEPS, 2, world, MICRO)
    ref_losses, ref_norms, ref_state = reference_run(base, make_optimizer, batches, 0.5)
    eager = copy.deepcopy(base)
    eager, eager_opt = zs.initialize(eager, make_optimizer(eager), _config(ratio))
    eager_losses, _ = _train(eager, eager_opt, batches, 2, True, "cpu")
    model = copy.deepcopy(base)
    model, opt = zs.initialize(model, make_optimizer(model), _config(ratio))
    homes = {g.home.kind for g in zs.engine_state(model).groups if g.trainable}
    assert homes == ({zs.HomeKind.HOST} if ratio == 1 else set(zs.HomeKind)), homes
    compiled = zc.compile(model, backend="aot_eager")
    losses, norms = _train(compiled, opt, batches[: STEPS - 1], 2, True, "cpu")
    path = Path(root) / f"r{ratio}"
    zs.save_checkpoint(compiled, opt, path, step=STEPS - 1)
    more, more_norms = _train(compiled, opt, batches[STEPS - 1 :], 2, True, "cpu")
    assert not compiled.eager and compiled.compiles == 1, compiled.compiles
    torch.testing.assert_close(losses + more, ref_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(losses + more, eager_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norms + more_norms, ref_norms, rtol=1e-5, atol=1e-6)
    full = zs.full_state_dict(model)
    for name, want in ref_state.items():
        torch.testing.assert_close(full[name], want, rtol=1e-5, atol=1e-6, msg=name)
    # Resumed in the same combination: the last step again, to the last bit.
    again = copy.deepcopy(base)
    again, again_opt = zs.initialize(again, make_optimizer(again), _config(ratio))
    again_compiled = zc.compile(again, backend="aot_eager")
    zs.load_checkpoint(again_compiled, again_opt, path)
    resumed, _ = _train(again_compiled, again_opt, batches[STEPS - 1 :], 2, True, "cpu")
    assert resumed == more
    for name, value in zs.full_state_dict(again).items():
        assert torch.equal(value, full[name]), name


def _bf16_case(reduce_dtype: str) -> None:
    """The compiled run is the eager one, bit for bit, whatever dtype gradients land in."""
    base = make_model(seed=8)
    batches = global_batches(STEPS, 1, dist.get_world_size(), MICRO)
    config = _config(1.0, compute_dtype="bf16", reduce_dtype=reduce_dtype)
    runs = []
    for compile_it in (False, True):
        model = copy.deepcopy(base)
        model, opt = zs.initialize(model, make_optimizer(model), config)
        run = zc.compile(model, backend="aot_eager") if compile_it else model
        losses, norms = _train(run, opt, batches, 1, True, "cpu")
        runs.append((losses, norms, zs.full_state_dict(model)))
    (losses, norms, state), (c_losses, c_norms, c_state) = runs
    assert (c_losses, c_norms) == (losses, norms)
    for name, value in state.items():
        assert torch.equal(c_state[name], value), name


def _offload_params_refused() -> None:
    model = make_model(seed=9)
    model, _ = zs.initialize(model, make_optimizer(model), _config(1.0, offload_params=True))
    with pytest.raises(ValueError, match="offload_params: the compiled graph takes every"):
        zc.compile(model, backend="aot_eager")


def _all(root: str) -> None:
    run_each([dict(ratio=r) for r in (1.0, 0.5)], lambda **c: _fp32_case(**c, root=root))
    run_each([dict(reduce_dtype=d) for d in ("bf16", "fp32")], lambda **c: _bf16_case(**c))
    run_each([{}], _offload_params_refused)


def test_compiled_offload(tmp_path: Path) -> None:
    run_ranks(_all, 2, str(tmp_path))
