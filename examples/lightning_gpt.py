"""Train the small GPT of gpt.py with PyTorch Lightning's Trainer on zeroshard.

    torchrun --standalone --nproc-per-node=2 examples/lightning_gpt.py --strategy zeroshard_stage_3
    python examples/lightning_gpt.py --devices 2 --strategy zeroshard_stage_2

Under torchrun the ranks are torchrun's; without it, Lightning starts `--devices` ranks
itself. The engine is chosen by one argument, as with any Lightning strategy:
`--strategy ddp` trains the same model on the same batches with Lightning's DDP, and
`zeroshard`, `zeroshard_stage_1` ... `zeroshard_stage_3_offload` with zeroshard (importing
`zeroshard.engine.lightning` registers those names). The Trainer's own flags keep their
meaning: `--precision` (auto: bf16-mixed on CUDA, 32-true on CPU), `--accum`
(accumulate_grad_batches), `--clip` (gradient_clip_val, the global norm, logged as
grad_norm), `--ckpt-dir` (ModelCheckpoint every `--save-every` steps and last.ckpt:
sharded directories under zeroshard, consolidated by `zeroshard-ckpt consolidate`) and
`--resume PATH` (`fit(ckpt_path=...)`, at any number of ranks).

Byte-level tokens of data/corpus.txt: each sample is a window at an offset drawn from a
generator seeded by its index, so the data are the same whatever the strategy.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from gpt import GPT, GPTConfig  # type: ignore[import-not-found]
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

import zeroshard.engine.lightning  # noqa: F401  (registers the strategy names)

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"


class CorpusWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """`count` windows of `seq_len + 1` bytes of `data`: (input, next-byte target)."""

    def __init__(self, data: torch.Tensor, seq_len: int, count: int, seed: int) -> None:
        self.data, self.seq_len, self.count, self.seed = data, seq_len, count, seed

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        start = int(torch.randint(0, len(self.data) - self.seq_len - 1, (1,), generator=g))
        window = self.data[start : start + self.seq_len + 1]
        return window[:-1], window[1:]


class GPTModule(pl.LightningModule):
    """The GPT with AdamW and a warm-up then cosine learning rate, stepped every step."""

    def __init__(self, cfg: GPTConfig, lr: float, steps: int) -> None:
        super().__init__()
        self.model = GPT(cfg)
        self.lr, self.steps = lr, steps

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.model(*batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], idx: int) -> None:
        self.log("val_loss", self.model(*batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95), weight_decay=0.1)
        warmup = max(1, self.steps // 20)

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (self.steps - warmup))))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description="Train a small GPT with Lightning on zeroshard.")
    p.add_argument("--strategy", default="zeroshard_stage_2", help="a Lightning strategy name")
    p.add_argument("--devices", type=int, default=1, help="ranks Lightning starts (no torchrun)")
    p.add_argument("--precision", default="auto", help="auto: bf16-mixed on CUDA, 32-true on CPU")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per micro-batch")
    p.add_argument("--accum", type=int, default=1, help="accumulate_grad_batches")
    p.add_argument("--clip", type=float, default=1.0, help="gradient_clip_val (0: off)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--preset", default="tiny", help="gpt.py preset (default tiny)")
    p.add_argument("--seq-len", type=int, default=None, help="override the preset's seq_len")
    p.add_argument("--ckpt-dir", type=Path, default=None, help="ModelCheckpoint directory")
    p.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps")
    p.add_argument("--resume", default=None, help="a checkpoint to resume from (or 'last')")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> pl.Trainer:
    """Train; the Trainer, for its `callback_metrics` and `logged_metrics`."""
    args = parse_args(argv)
    overrides = {"seq_len": args.seq_len} if args.seq_len else {}
    cfg = GPTConfig.preset(args.preset, **overrides)
    pl.seed_everything(args.seed, verbose=False)
    data = torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8).long()
    split = len(data) * 9 // 10
    train = CorpusWindows(data[:split], cfg.seq_len, args.steps * args.batch * args.accum, 1)
    val = CorpusWindows(data[split:], cfg.seq_len, 4 * args.batch, 2)
    precision = args.precision
    if precision == "auto":
        precision = "bf16-mixed" if torch.cuda.is_available() else "32-true"
    # Under torchrun the ranks exist already: Lightning takes them from its environment.
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", args.devices))
    nodes = int(os.environ.get("WORLD_SIZE", devices)) // devices
    callbacks: list[pl.Callback] = []
    if args.ckpt_dir is not None:
        callbacks.append(
            ModelCheckpoint(
                args.ckpt_dir, "{step}", every_n_train_steps=args.save_every, save_last=True
            )
        )
    trainer = pl.Trainer(
        strategy=args.strategy,
        accelerator="auto",
        devices=devices,
        num_nodes=nodes,
        precision=precision,
        max_steps=args.steps,
        accumulate_grad_batches=args.accum,
        gradient_clip_val=args.clip or None,
        log_every_n_steps=1,
        callbacks=callbacks,
        enable_checkpointing=args.ckpt_dir is not None,
        logger=False,
    )
    module = GPTModule(cfg, args.lr, args.steps)
    trainer.fit(
        module,
        DataLoader(train, batch_size=args.batch),
        DataLoader(val, batch_size=args.batch),
        ckpt_path=args.resume,
    )
    return trainer


if __name__ == "__main__":
    main()
