"""DeepSpeed ZeRO-3 checkpoints: DeepSpeed's ranks write one, zero_to_fp32 is the peer."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from benchmarks.consolidate._model import GPT
from benchmarks.consolidate._source import Checkpoint, Command


@dataclass(frozen=True)
class DeepSpeedSource:
    """DeepSpeed itself makes the checkpoint: the GPT built under `deepspeed.zero.Init`, one
    AdamW step with ZeRO-3 in bf16, `save_checkpoint`. The peer: zero_to_fp32
    (`--safe_serialization`; if that fails, as it does on tied weights, its pickle .bin)."""

    name: str = "deepspeed"
    section: str = "consolidate"
    title: str = "Consolidating a DeepSpeed ZeRO-3 checkpoint"
    kind: str = "DeepSpeed ZeRO-3 checkpoint"
    made_by: str = "DeepSpeed"
    shard_files: str = "optimizer files"
    peer: str = "zero_to_fp32"
    has_goals: bool = True

    def make_rank(self, rank: int, world: int, args: argparse.Namespace, out: Path) -> None:
        """One AdamW step of ZeRO-3 in bf16, then `save_checkpoint(out)`."""
        import deepspeed  # type: ignore[import-untyped, unused-ignore]

        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": 3},
            "bf16": {"enabled": True},
            "steps_per_print": 10**9,
        }
        torch.manual_seed(0)
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = GPT(args.vocab, args.d_model, args.layers, tied=not args.untied)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        tokens = torch.randint(0, args.vocab, (1, 16), device=engine.device)
        logits = engine(tokens)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
        engine.backward(loss)
        engine.step()
        engine.save_checkpoint(str(out), tag="global_step1")

    def read(self, ckpt: Path) -> Checkpoint:
        """The layout zeroshard reads from the checkpoint (fp32 masters, frozen, buffers)."""
        from zeroshard.ckpt._deepspeed import read_deepspeed_checkpoint

        layout = read_deepspeed_checkpoint(ckpt)
        return Checkpoint(
            numels=[s.numel for s in layout.specs],
            dtypes=[s.dtype for s in layout.specs],
            world=layout.world_size,
            shard_files=sorted(ckpt.rglob("*_optim_states.pt")),
        )

    def peer_commands(self) -> list[Command]:
        """zero_to_fp32 with `--safe_serialization`, then without (its .bin)."""
        base = [sys.executable, "-m", "deepspeed.utils.zero_to_fp32"]
        return [
            Command(
                "zero_to_fp32 --safe_serialization",
                lambda c, o: [*base, str(c), str(o), "--safe_serialization"],
            ),
            Command("zero_to_fp32 (.bin)", lambda c, o: [*base, str(c), str(o)]),
        ]
