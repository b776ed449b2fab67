"""The compiled model is the model: every engine function takes the `CompiledModel`.

World 2, gloo, one compiled model (one capture, aot_eager) trained a step, then:
`engine_state` / `engine_stats` are the module's; `state_dict()`, `parameters()`,
`named_parameters()`, `train()` / `eval()` are the wrapped module's; `full_state_dict`,
`gathered_parameters` (whole model, and a submodule with `model=`; an edit kept with
`modifier_rank`), `save_checkpoint` / `load_checkpoint` (a step after saving, loading
restores the saved weights exactly and training goes on compiled) and `load_safetensors`
(the weights read are exactly the file's) all work given the wrapper.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

import zeroshard.compile as zc
import zeroshard.engine as zs
from tests._dist import run_ranks
from tests.engine._models import global_batches, loss_fn, make_model, make_optimizer

CONFIG = {"stage": 3, "min_unit_params": 1, "persistence_threshold": 0}


def _exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def _wrapper(directory: str) -> None:
    rank = dist.get_rank()
    model = make_model(seed=11)
    model, opt = zs.initialize(model, make_optimizer(model), CONFIG)
    compiled = zc.compile(model, backend="aot_eager")
    batches = global_batches(3, 1, dist.get_world_size(), 2)

    def step(i: int) -> None:
        loss_fn(compiled, batches[i, 0, rank]).backward()
        opt.step()
        opt.zero_grad()

    step(0)
    assert not compiled.eager
    assert zs.engine_state(compiled) is zs.engine_state(model)
    assert zs.engine_stats(compiled) is zs.engine_stats(model)
    assert list(compiled.parameters()) == list(model.parameters())
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in model.named_parameters()]
    _exact(compiled.state_dict(), model.state_dict())
    assert compiled.eval() is compiled and not model.training and not compiled.training
    assert compiled.train() is compiled and model.training and compiled.training

    saved = zs.full_state_dict(compiled)
    _exact(saved, zs.full_state_dict(model))
    # Full tensors, not shards, through the wrapper as from the engine's model.
    _exact({k: v.detach().cpu() for k, v in compiled.state_dict().items()}, saved)
    with zs.state_dict_on_rank0(compiled):
        on_rank0 = compiled.state_dict()
    _exact(on_rank0, saved if rank == 0 else {})
    with zs.gathered_parameters(compiled):
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), saved[name], rtol=0, atol=0, msg=name)
    with zs.gathered_parameters(model.l2, modifier_rank=0, model=compiled), torch.no_grad():
        model.l2.bias.add_(1.0 if rank == 0 else -5.0)  # rank 0's edit wins
    edited = zs.full_state_dict(compiled)
    torch.testing.assert_close(edited["l2.bias"], saved["l2.bias"] + 1.0)

    zs.save_checkpoint(compiled, opt, directory, step=1)
    step(1)
    assert zs.full_state_dict(compiled)["head.weight"].ne(edited["head.weight"]).any()
    assert zs.load_checkpoint(compiled, opt, directory) == 1
    _exact(zs.full_state_dict(compiled), edited)
    step(2)  # the compiled graph trains on from the loaded shards

    weights = {k: torch.randn_like(v) for k, v in zs.full_state_dict(compiled).items()}
    weights["head.weight"] = weights["emb.weight"].clone()  # tied
    file = os.path.join(directory, "weights.safetensors")
    if rank == 0:
        save_file(weights, file)
    dist.barrier()
    assert zs.load_safetensors(compiled, file).param_bytes > 0
    _exact(zs.full_state_dict(compiled), weights)
    compiled.load_state_dict(saved)
    _exact(zs.full_state_dict(compiled), saved)
    assert compiled.compiles == 1

    with pytest.raises(ValueError, match=r"initialized with zeroshard\.engine\.initialize"):
        zs.full_state_dict(object())  # type: ignore[arg-type]


def test_compiled_model_is_the_model(tmp_path: Path) -> None:
    run_ranks(_wrapper, 2, str(tmp_path))


_ALIVE_AT_EXIT = """
import torch, torch.distributed as dist
import zeroshard.compile as zc, zeroshard.engine as zs
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
model, _ = zs.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {config})
# Held by something that outlives the modules (as a cache may): finalized after them.
torch.keep_alive = zc.compile(model, backend="aot_eager")
print("built")
"""


def test_a_compiled_model_alive_at_exit_leaves_quietly() -> None:
    """No "Exception ignored in CompiledModel.__del__" traceback when the interpreter
    exits (unregistering its targets raised on the cleared module's None registry)."""
    import subprocess
    import sys

    from tests._dist import free_port

    script = _ALIVE_AT_EXIT.format(port=free_port(), config=CONFIG)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "built", done.stderr[-3000:]
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr[
        -3000:
    ]
