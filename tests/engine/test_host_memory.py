"""initialize checks that the host can hold the offloaded state before allocating it.

The bound is read from files (cgroup v2 or v1, /proc/meminfo); the reader is tested on
fixture trees of each kind, and a real initialize on two gloo ranks is pointed at a
fixture that leaves too little memory: every rank raises the same error naming the bytes
needed and available, and the process group still works after it; so does the first
backward that needs the host gradient, checked when it is allocated. The optimizer state
it counts is the planner's (`Estimate.host_state`): per element for torch's optimizers,
and for one stepping whole parameters the state its step allocates on the matrices each
rank owns ([Note: a declared optimizer's state, measured]).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zeroshard.engine as zs
from tests._dist import run_ranks
from tests.engine._models import (
    global_batches,
    loss_fn,
    make_model,
    make_optimizer,
    muon_and_adamw,
)
from tests.engine.test_whole_params_compositions import factored_and_adamw
from zeroshard.engine.runtime import _host_memory
from zeroshard.engine.runtime._host_memory import read_host_memory

GIB = 1024**3


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _meminfo(root: Path, available_kib: int) -> Path:
    text = f"MemTotal: {available_kib * 4} kB\nMemAvailable: {available_kib} kB\n"
    return _write(root / "meminfo", text)


def test_cgroup_v2_tightest_ancestor(tmp_path: Path) -> None:
    cg = tmp_path / "cg"
    own = _write(tmp_path / "self", "0::/job/step\n")
    _write(cg / "job/step/memory.max", "max\n")  # no limit of its own
    _write(cg / "job/step/memory.current", str(5 * GIB))
    _write(cg / "job/memory.max", str(100 * GIB))
    _write(cg / "job/memory.current", str(30 * GIB))
    mem = read_host_memory(own, cg, _meminfo(tmp_path, 200 * 1024**2))
    assert mem.available == 70 * GIB and "job/memory.max" in mem.source
    # MemAvailable below the cgroup's headroom wins.
    mem = read_host_memory(own, cg, _meminfo(tmp_path, 10 * 1024**2))
    assert mem.available == 10 * GIB and "MemAvailable" in mem.source


def test_cgroup_v1_and_unlimited(tmp_path: Path) -> None:
    cg = tmp_path / "cg"
    own = _write(tmp_path / "self", "5:cpu:/\n4:memory:/pod/c1\n0::/\n")
    _write(cg / "memory/pod/c1/memory.limit_in_bytes", str(64 * GIB))
    _write(cg / "memory/pod/c1/memory.usage_in_bytes", str(16 * GIB))
    mem = read_host_memory(own, cg, _meminfo(tmp_path, 100 * 1024**2))
    assert mem.available == 48 * GIB and "limit_in_bytes" in mem.source
    # No cgroup files at all (or v1's "no limit", a huge number): MemAvailable alone.
    _write(cg / "memory/pod/c1/memory.limit_in_bytes", str(2**63 - 4096))
    mem = read_host_memory(own, cg, _meminfo(tmp_path, 3 * 1024**2))
    assert mem.available == 3 * GIB and "MemAvailable" in mem.source
    mem = read_host_memory(tmp_path / "absent", cg, _meminfo(tmp_path, 1024))
    assert mem.available == 1024 * 1024


def test_this_host_reads() -> None:
    # The real files of this machine: a positive number from one of the two bounds.
    mem = read_host_memory()
    assert mem.available > 0 and mem.source


def _too_small(root: str) -> None:
    rank = dist.get_rank()
    # Each rank reads its own fixture: rank 1 has 1 MiB, rank 0 plenty.
    _host_memory.PROC_MEMINFO = _meminfo(Path(root) / str(rank), 1024 if rank else 10**9)
    _host_memory.PROC_SELF_CGROUP = Path(root) / "absent"
    model = make_model(seed=1)
    cfg = {"stage": 2, "compute_dtype": "bf16", "offload_optimizer": True}
    with pytest.raises(MemoryError) as err:
        zs.initialize(model, make_optimizer(model), cfg)
    message = str(err.value)
    assert "rank 1 needs" in message and "for the 2 ranks of its host" in message
    assert "1,048,576 (0.0 GiB) available" in message
    assert "rank 0 needs" not in message and "AdamW 12,288: 2 per element in fp32" in message
    # Nothing hangs: the group still works and a fitting initialize goes through.
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
    _host_memory.PROC_MEMINFO = _meminfo(Path(root) / str(rank), 10**9)
    model = make_model(seed=1)
    zs.initialize(model, make_optimizer(model), cfg)


def test_initialize_refuses_what_the_host_cannot_hold(tmp_path: Path) -> None:
    run_ranks(_too_small, 2, str(tmp_path))


def _held_too_small(root: str) -> None:
    rank = dist.get_rank()
    _host_memory.PROC_MEMINFO = _meminfo(Path(root) / str(rank), 10**9)
    _host_memory.PROC_SELF_CGROUP = Path(root) / "absent"
    model = make_model(seed=1)
    cfg = {"stage": 2, "compute_dtype": "bf16", "offload_optimizer": True}
    model, _ = zs.initialize(model, make_optimizer(model), cfg)
    # The gradients held until step() come with the first backward that needs them, and
    # are checked then: by now rank 1's host has 1 MiB left.
    _host_memory.PROC_MEMINFO = _meminfo(Path(root) / str(rank), 1024 if rank else 10**9)
    batch = global_batches(1, 1, 2, 2)[0, 0, rank]
    with pytest.raises(MemoryError) as err:
        loss_fn(model, batch).backward()
    message = str(err.value)
    assert "the offloaded gradients held until step()" in message, message
    assert "rank 1 needs" in message and "rank 0 needs" not in message
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2


def test_held_gradients_are_checked_when_first_needed(tmp_path: Path) -> None:
    """The host gradient (allocated at the first backward outside step_in_backward) is
    checked as initialize's state is: the same MemoryError on every rank, no hang."""
    run_ranks(_held_too_small, 2, str(tmp_path))


class Moments(torch.optim.Optimizer):
    """A whole-parameter optimizer that keeps three moments a matrix: 3 floats an element,
    more than the 2 an unknown optimizer was counted at."""

    zeroshard_whole_params = True

    def __init__(self, params: Any, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                for k, power in (("m1", 1), ("m2", 2), ("m3", 3)):
                    state.setdefault(k, torch.zeros_like(p)).lerp_(p.grad**power, 0.1)
                p.add_(state["m1"], alpha=-group["lr"])


RECIPES: dict[str, Any] = {
    "factored": factored_and_adamw,
    "muon": muon_and_adamw,
    "moments": lambda model: [Moments(model.parameters())],
}
OFFLOADED = {"stage": 2, "compute_dtype": "bf16", "offload_optimizer": True}


def _counted(root: str, recipe: str) -> tuple[int, int, int]:
    """What initialize counts on this rank for `recipe` with offload: the bytes of masters
    and staging, of the optimizer state, and of the recipe's first optimizer's state
    (read from its refusal on a 1 MiB host)."""
    _host_memory.PROC_MEMINFO = _meminfo(Path(root) / str(dist.get_rank()), 1024)
    model = make_model(seed=1)
    opts = RECIPES[recipe](model)
    with pytest.raises(MemoryError) as err:
        zs.initialize(model, opts, OFFLOADED)
    message = str(err.value)
    found = re.search(r"([\d,]+) bytes of masters and staging and ([\d,]+) of", message)
    first = re.search(rf"\({type(opts[0]).__name__} ([\d,]+):", message)
    assert found is not None and first is not None, message
    host, state = (int(n.replace(",", "")) for n in found.groups())
    return host, state, int(first.group(1).replace(",", ""))


# What the whole-parameter optimizers keep of a matrix: Factored r + c fp32 floats, three
# moments 3 an element.
KEPT: dict[str, Any] = {"factored": lambda p: 4 * sum(p.shape), "moments": lambda p: 12 * p.numel()}


def _counts_as_planned(root: str, recipe: str) -> None:
    _host_memory.PROC_SELF_CGROUP = Path(root) / "absent"
    host, state, first = _counted(root, recipe)
    counted: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(counted, (state, first))
    states = [s for s, _ in counted]
    # The planner's figure for the same model and optimizers: the busiest rank's.
    with torch.device("meta"):
        meta = make_model(seed=1)
    opts = RECIPES[recipe](meta)
    est = zs.estimate(meta, OFFLOADED, 2, 2, 5, optimizer=opts)
    assert max(states) == est.host_state, (states, est.host_state)
    if recipe in KEPT:
        # Each trained matrix's state once, on its owner's host, and none per element.
        params = [p for pg in opts[0].param_groups for p in pg["params"] if p.requires_grad]
        kept = sum(KEPT[recipe](p) for p in params)
        assert sum(f for _, f in counted) == kept, (counted, kept)
    if recipe == "moments":
        # A host that holds what this rank counts takes it; a KiB less, refused.
        rank = dist.get_rank()
        need_kib = -(-2 * (host + state) // 1024)
        _host_memory.PROC_MEMINFO = _meminfo(Path(root) / str(rank), need_kib)
        model = make_model(seed=1)
        zs.initialize(model, RECIPES[recipe](model), OFFLOADED)
        short = need_kib - 1 if state == max(states) else need_kib
        _host_memory.PROC_MEMINFO = _meminfo(Path(root) / str(rank), short)
        model = make_model(seed=1)
        with pytest.raises(MemoryError, match=r"Moments [\d,]+: measured"):
            zs.initialize(model, RECIPES[recipe](model), OFFLOADED)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_offloaded_state_is_counted_as_planned(tmp_path: Path, recipe: str) -> None:
    """initialize's host check counts each optimizer's state as `zs.estimate` prices it
    (the busiest rank's equal to `Estimate.host_state`): Muon's momentum per element,
    and a whole-parameter optimizer's state once per matrix, at its owner (over the
    ranks: Factored's r + c floats a matrix, three moments an element), whose host is
    refused a KiB short of what it counts and takes it at that."""
    run_ranks(_counts_as_planned, 2, str(tmp_path), recipe)
