"""benchmarks/train_step with `--optimizer muon`: the smoke run on CPU (floors with Muon,
zeroshard on the device and offloaded, DeepSpeed's own Muon), and the owners the 1.3B
benchmark models get at world 8, planned from shapes alone."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zeroshard.engine as zs
from benchmarks._common._models import bench_model, optimizers
from tests._dist import free_port
from zeroshard.engine.planner._groups import plan_groups
from zeroshard.engine.planner._whole import hidden_matrices, whole_matrix_cost

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_run_times_muon_in_every_engine() -> None:
    env = {**os.environ, "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    engines = "floor32,floor32-adamw,zs2,zs3,zs3-off,ds3"
    cmd = [sys.executable, "-m", "benchmarks.train_step", "--smoke", "--optimizer", "muon"]
    cmd += ["--engines", engines, "--section", "train_step_muon_test"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for engine in engines.split(","):
        assert re.search(rf"^\| `{engine}` \|.*\| ok \|$", done.stdout, re.M), done.stdout
    assert "torch.optim.Muon on the hidden matrices" in done.stdout
    assert re.search(r"^\| `zs2` speed / `floor32` \| [\d.]+ \| >= 0\.97 \|", done.stdout, re.M)
    assert "Muon's step over AdamW's" in done.stdout and "DeepSpeed's Muon" in done.stdout
    # Muon with its optimizer state offloaded, beside Muon on the device.
    assert re.search(r"^\| `zs3-off` \| `zs3` \| [\d.]+ / [\d.]+ \| [\d.]+ \|", done.stdout, re.M)


@pytest.mark.parametrize("name", ["gpt", "llama", "hf-llama"])
def test_owners_balance_newton_schulz_on_the_1_3b_presets(name: str) -> None:
    """From shapes only (meta device, no process group): at world 8 the busiest rank
    orthogonalizes at most 1.10x the mean, at stages 2 and 3, and the exchange with the
    owners is a small part of what the step's other collectives send."""
    if name == "hf-llama":
        pytest.importorskip("transformers")
    bm = bench_model(name, "1.3b", smoke=False, seq_len=None, activation_checkpointing=False)
    with torch.device("meta"):
        model = bm.build()
    opts = optimizers(list(model.parameters()), hidden_matrices(model), torch.device("cpu"), "muon")
    groups_of = {
        id(p): k
        for k, pg in enumerate(opts[0].param_groups + opts[1].param_groups)
        for p in pg["params"]
    }
    for stage in (2, 3):
        cfg = zs.ZeroConfig.from_dict({"stage": stage, "compute_dtype": "bf16"})
        plan = plan_groups(model, cfg, 8, groups_of)
        cost = whole_matrix_cost(plan.groups, cfg, opts)
        assert cost is not None and len(cost.owners.matrices) == sum(hidden_matrices(model))
        assert cost.balance <= 1.10, (stage, cost.balance)
        assert cost.sent_bytes < 0.2 * cost.other_bytes, (stage, cost.sent_bytes, cost.other_bytes)
    # The public planner reports the same plan.
    est = zs.estimate(model, {"stage": 3, "compute_dtype": "bf16"}, 8, 1, 64, optimizer=opts)
    assert est.whole_matrix is not None and est.whole_matrix.balance <= 1.10
