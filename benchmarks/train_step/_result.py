"""One engine's figures (`Result`) and the JSON file of a run, which benchmarks/scaling reads."""

from __future__ import annotations

import argparse
import datetime
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks._common import SMOKE_OUT, command
from benchmarks._common._models import BenchModel
from benchmarks.train_step._compile import CompileTime
from benchmarks.train_step._settings import Settings
from benchmarks.train_step._trace import TraceSummary


@dataclass(frozen=True)
class Result:
    """One engine's row; `error` (failed) or `skipped` (does not apply) leave the figures None."""

    engine: str
    what: str
    init_s: float | None = None
    step_ms: float | None = None
    peak_gib: float | None = None
    error: str | None = None
    trace: TraceSummary | None = None
    left_gib: float = 0.0  # still allocated after the engine was freed: a leak into the next
    build_s: float | None = None  # model construction on the device, before wrapping
    states_gib: float | None = None  # kept allocated between steps (model states)
    skipped: str | None = None
    rounds_ms: tuple[float, ...] = ()  # each round's median step, in the order run
    tp: int = 1  # GPUs computing each token together (a tensor-parallel engine's --tp)

    def tokens_per_s_per_gpu(self, tokens_per_step: int) -> float | None:
        """Tokens a second per GPU, of `tokens_per_step` per rank and step."""
        return tokens_per_step / self.tp / (self.step_ms / 1000) if self.step_ms else None


def save_json(
    results: list[Result],
    bm: BenchModel,
    args: argparse.Namespace,
    settings: Settings,
    world: int,
    ranks: str,
    compile_times: list[CompileTime],
) -> Path:
    """bench-out/<section>.json: every row plus what it was measured on and with."""
    cuda = settings.device.type == "cuda"
    tokens = args.micro_batch * bm.seq_len
    meta = {
        "section": args.section,
        "model_name": bm.name,
        "preset": bm.preset,
        "model": bm.config,
        "parameters": bm.parameters,
        "flops_per_token": bm.flops_per_token,
        "world": world,
        "ranks": ranks,
        "micro_batch": args.micro_batch,
        "seq_len": bm.seq_len,
        "tokens_per_step_per_gpu": tokens,
        "dtype": str(settings.dtype).removeprefix("torch."),
        "activation_checkpointing": args.activation_checkpointing,
        "shard_group_size": settings.shard_group_size,
        "clip": args.clip,
        "optimizer": settings.optimizer,
        "warmup": args.warmup,
        "steps": args.steps,
        "rounds": args.rounds,
        "zs_config": settings.zs_config,
        "device": torch.cuda.get_device_name(settings.device) if cuda else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "date": datetime.date.today().isoformat(),
        "command": command(),
    }
    rows = []
    for r in results:
        row = asdict(r)
        row["tokens_per_s_per_gpu"] = r.tokens_per_s_per_gpu(tokens)
        rows.append(row)
    SMOKE_OUT.mkdir(exist_ok=True)
    path = SMOKE_OUT / f"{args.section}.json"
    compiled = [asdict(t) for t in compile_times]
    path.write_text(json.dumps({"meta": meta, "results": rows, "compile": compiled}, indent=1))
    return path
