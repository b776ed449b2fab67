"""benchmarks/train_step's compile-time probe splits a compile into its phases and counts
the compile caches: run for real, one rank, on a tiny model compiled by inductor on CPU,
first with an empty inductor cache directory, then in a second process on the directory
the first left."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from benchmarks._common._models import bench_model
from benchmarks.train_step._compile import CACHES, PHASES, CompileTime, Probe, probe
from benchmarks.train_step._goals import compile_table
from benchmarks.train_step._settings import Settings
from tests._dist import run_ranks


def _probe(engine: str, tmp: str, kind: str) -> None:
    torch.set_num_threads(1)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")
    bm = bench_model("gpt", "1.3b", smoke=True, seq_len=16, activation_checkpointing=False)
    settings = Settings(torch.device("cpu"), torch.bfloat16, 0.0, 2, {})
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, bm.vocab_size, (2, bm.seq_len + 1), generator=g)
    probe(engine, bm, settings, (tokens[:, :-1], tokens[:, 1:]), Path(tmp) / f"{kind}.json")


def _cold_and_warm(engine: str, tmp: Path) -> tuple[Probe, Probe]:
    """Two probes in two processes (as `--compile-time` runs them) on one cache directory."""
    probes = []
    for kind in ("cold", "warm"):
        run_ranks(_probe, 1, engine, str(tmp), kind, timeout_s=600)
        probes.append(Probe(**json.loads((tmp / f"{kind}.json").read_text())))
    return probes[0], probes[1]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["floorc", "zs3c"])
def test_probe_splits_the_compile(engine: str, tmp_path: Path) -> None:
    cold, warm = _cold_and_warm(engine, tmp_path)
    assert set(cold.phases) <= set(PHASES) and set(cold.caches) == set(CACHES)
    for phase in ("dynamo", "aot trace", "lowering", "codegen"):
        assert cold.phases[phase] > 0, phase
    assert cold.caches["fx graph miss"] >= 1 and cold.caches["fx graph hit"] == 0
    # The second process loads what the first compiled: it traces, but lowers nothing.
    assert warm.caches["fx graph miss"] == 0 and warm.caches["aot hit"] >= 1, warm.caches
    assert warm.phases.get("lowering", 0.0) == 0.0
    assert warm.phases["dynamo"] > 0
    passes = cold.phases.get("zeroshard passes", 0.0)
    assert (passes > 0) == (engine == "zs3c"), passes
    table = "\n".join(compile_table([CompileTime(engine, cold, warm)]))
    assert f"| `{engine}` warm |" in table
