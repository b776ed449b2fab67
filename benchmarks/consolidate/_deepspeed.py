"""DeepSpeed ZeRO-3 checkpoints: DeepSpeed's ranks write one, zero_to_fp32 is the peer."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.consolidate._model import GPT
from benchmarks.consolidate._source import Checkpoint, Command, Source


def make_rank(rank: int, world: int, args: argparse.Namespace, out: Path) -> None:
    """DeepSpeed itself makes the checkpoint: the GPT built under `deepspeed.zero.Init`,
    one (fused) AdamW step with ZeRO-3 in bf16, `save_checkpoint(out)`."""
    import deepspeed  # type: ignore[import-untyped, unused-ignore]

    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": True},
        "steps_per_print": 10**9,
    }
    start = time.perf_counter()
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = GPT(args.vocab, args.d_model, args.layers, tied=not args.untied)
    # Fused: one pass over the fp32 partitions, a third of the step on 1-thread CPU ranks.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    built = time.perf_counter()
    tokens = torch.randint(0, args.vocab, (1, 16), device=engine.device)
    logits = engine(tokens)
    loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
    engine.backward(loss)
    engine.step()
    stepped = time.perf_counter()
    engine.save_checkpoint(str(out), tag="global_step1")
    if rank == 0:  # where the time of making a large checkpoint goes
        print(
            f"[consolidate] DeepSpeed rank 0: built and initialized in {built - start:.1f} s, "
            f"one step {stepped - built:.1f} s, saved in {time.perf_counter() - stepped:.1f} s",
            flush=True,
        )


def read(ckpt: Path) -> Checkpoint:
    """The layout zeroshard reads from the checkpoint (fp32 masters, frozen, buffers)."""
    from zeroshard.ckpt.foreign._deepspeed import read_deepspeed_checkpoint

    layout = read_deepspeed_checkpoint(ckpt)
    return Checkpoint(layout.specs, layout.world_size, sorted(ckpt.rglob("*_optim_states.pt")))


_ZERO_TO_FP32 = [sys.executable, "-m", "deepspeed.utils.zero_to_fp32"]

DEEPSPEED = Source(
    name="deepspeed",
    section="consolidate",
    title="Consolidating a DeepSpeed ZeRO-3 checkpoint",
    kind="DeepSpeed ZeRO-3 checkpoint",
    made_by="DeepSpeed",
    shard_files="optimizer files",
    peer="zero_to_fp32",
    make_rank=make_rank,
    read=read,
    # --safe_serialization refuses tied weights; then its pickle .bin is timed.
    peer_commands=(
        Command(
            "zero_to_fp32 --safe_serialization",
            lambda c, o: [*_ZERO_TO_FP32, str(c), str(o), "--safe_serialization"],
        ),
        Command("zero_to_fp32 (.bin)", lambda c, o: [*_ZERO_TO_FP32, str(c), str(o)]),
    ),
    has_goals=True,
)
