"""Every collective honours `collective_timeout_s`, and a rank that timed out can exit.

A peer that stops answering (alive, elsewhere) at each stage's step, and the common
mistake of calling a collective API on rank 0 only: rank 0 gets `CollectiveTimeoutError`
naming the call within the timeout (a step's, a save's collective), or within the
arrival window (`zeroshard.comm.arrive`: `full_state_dict`, `load_safetensors`,
`model.state_dict()` at stage 3, the DDP habit, whose error names `zs.state_dict_on_rank0`;
the engine stays usable, so both ranks then take its state dict on rank 0). Each case
runs on a fresh subgroup, which an abandoned collective leaves unusable, while the peer
waits on the world group.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

import zeroshard.engine as zs
from tests._dist import free_port, run_each, run_ranks
from tests.engine._models import make_model
from tests.faults._engine import SLACK_S, TIMEOUT_S, build, train_step
from zeroshard.comm import CollectiveTimeoutError, Group

REPO = Path(__file__).resolve().parents[2]


def _rank0_alone(stage: int, call: str, root: str, expect: str) -> None:
    group = Group(dist.new_group([0, 1]))
    model, opt = build(stage, group=group)
    if dist.get_rank() == 0:
        actions: dict[str, Callable[[], object]] = {
            "step": lambda: train_step(model, opt, 0),
            "save": lambda: zs.save_checkpoint(model, opt, root, step=10 + stage),
            "full_state_dict": lambda: zs.full_state_dict(model),
            "state_dict": lambda: model.state_dict(),
            "load_safetensors": lambda: zs.load_safetensors(model, Path(root) / "w.safetensors"),
        }
        start = time.monotonic()
        with pytest.raises(CollectiveTimeoutError) as info:
            actions[call]()
        elapsed = time.monotonic() - start
        msg = str(info.value)
        assert info.value.timed_out and f"within {TIMEOUT_S:g}s" in msg, msg
        assert expect in msg, msg
        assert elapsed <= TIMEOUT_S + SLACK_S, elapsed
    # The peer is alive meanwhile, here, on the world group.
    Group().barrier(label="case done")
    if call == "state_dict":  # an arrival abandons no collective: the engine goes on
        with zs.state_dict_on_rank0(model):
            full = model.state_dict()
        assert (len(full) > 0) == (dist.get_rank() == 0)
    if call == "load_safetensors":  # nothing was read on rank 0, the same weights
        weights = zs.full_state_dict(model)
        assert all(torch.equal(weights[k], v) for k, v in make_model(11).state_dict().items())


def _cases(root: str) -> None:
    if dist.get_rank() == 0:
        weights = make_model(12).state_dict()  # other weights than build()'s
        save_file({k: v for k, v in weights.items() if k != "head.weight"}, f"{root}/w.safetensors")
    # Stage 3's step is covered by tests/engine (it honoured the timeout before).
    cases = [
        {"stage": 1, "call": "step", "expect": "reduce_scatter for 'grads of group"},
        {"stage": 2, "call": "step", "expect": "reduce_scatter for 'grads of group"},
        {"stage": 2, "call": "save", "expect": "save of 'step-12'"},
        {"stage": 1, "call": "full_state_dict", "expect": "'zs.full_state_dict'"},
        {"stage": 3, "call": "state_dict", "expect": "inside `with zs.state_dict_on_rank0"},
        {"stage": 2, "call": "load_safetensors", "expect": "'zs.load_safetensors'"},
    ]
    run_each([dict(c, root=root) for c in cases], _rank0_alone)


def test_rank0_alone_times_out_naming_the_call(tmp_path: Path) -> None:
    run_ranks(_cases, 2, str(tmp_path), timeout_s=240)


def _peer(mode: str, rank: int, port: int) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *sys.path]))
    return subprocess.Popen(
        [sys.executable, "-m", "tests.faults._peer", mode, str(rank), str(port)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_rank_crash_or_stall_mid_step_then_prompt_exit() -> None:
    """Rank 1 dies mid-step (crash) or stops answering (stall): rank 0 raises promptly and
    its normal interpreter exit does not wait for the live peer."""
    procs = {}
    for mode in ("crash", "stall"):
        port = free_port()
        procs[mode] = (_peer(mode, 0, port), _peer(mode, 1, port))
    try:
        for mode, (p0, p1) in procs.items():
            out, _ = p0.communicate(timeout=120)
            # The rank exits without waiting for its peer, with its own status (no SIGABRT
            # from a gloo worker freeing a tensor at finalization: docs/reliability.md).
            assert p0.returncode == 0, out
            line = next(x for x in out.splitlines() if x.startswith(("ERROR", "NO ERROR")))
            assert line.startswith("ERROR"), out
            elapsed = float(line.split()[1])
            assert elapsed <= TIMEOUT_S + SLACK_S, line
            assert "reduce_scatter for 'grads of group" in line, line
            if mode == "crash":
                assert p1.wait(timeout=30) == 3
            else:  # rank 0 exited while its peer still sleeps
                assert p1.poll() is None, "the stalled peer exited first: nothing measured"
    finally:
        for p0, p1 in procs.values():
            for p in (p0, p1):
                if p.poll() is None:
                    p.kill()
                    p.wait()
