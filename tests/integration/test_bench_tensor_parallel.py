"""benchmarks/train_step's tensor-parallel engines in a CPU smoke run at dp 2 x tp 2:
`zs3tp` and `fsdp2tp` (examples/llama.py split over tp by torch's tensor parallelism,
sharded over dp) and `zs3m` (zs3 through a (world, 1) mesh) step, and the report counts
each tensor-parallel GPU's tokens as 1/tp of its ranks' tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests._dist import free_port

ROOT = Path(__file__).resolve().parents[2]
SECTION = "train_step_tp_smoke"


def test_tensor_parallel_engines_step_at_dp2_tp2() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4"]
    rendezvous = ["--master-addr=127.0.0.1", f"--master-port={free_port()}"]
    bench = ["-m", "benchmarks.train_step", "--smoke", "--model", "llama", "--tp", "2"]
    options = ["--engines", "zs3m,zs3tp,fsdp2tp", "--no-write", "--section", SECTION]
    cmd = [*torchrun, *rendezvous, *bench, *options]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = json.loads((ROOT / "bench-out" / f"{SECTION}.json").read_text())
    rows = {r["engine"]: r for r in run["results"]}
    assert rows.keys() == {"zs3m", "zs3tp", "fsdp2tp"}, rows.keys()
    tokens = run["meta"]["tokens_per_step_per_gpu"]
    for name, tp in (("zs3m", 1), ("zs3tp", 2), ("fsdp2tp", 2)):
        row = rows[name]
        assert row["error"] is None and row["skipped"] is None and row["step_ms"] > 0, row
        assert row["tp"] == tp, row
        want = tokens / tp / (row["step_ms"] / 1000)
        assert abs(row["tokens_per_s_per_gpu"] - want) < 1e-6 * want, row
    assert "split over tp 2" in rows["zs3tp"]["what"], rows["zs3tp"]
