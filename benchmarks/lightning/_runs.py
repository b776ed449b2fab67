"""The three runs the benchmark times, each on a freshly built model in this process.

- `lightning`: `Trainer(strategy="zeroshard_stage_3", precision=...)` fitting a
  LightningModule whose `training_step` is the model's loss, with the AdamW of every
  benchmark (`benchmarks._common.adamw`); a callback synchronizes the device and reads the
  clock at the end of every batch, so a step is everything the Trainer does from one
  batch's end to the next (data fetch, hooks, forward, backward, the engine's step).
- `zs3`: the same model, optimizer and config through `zs.initialize` and the loop
  benchmarks/train_step times as its `zs3` engine: forward, backward, step, zero_grad, the
  device synchronized after each step.
- `single`: Lightning's own single-device run (`strategy="auto"`, the same precision flag,
  Lightning's autocast), for the loss only.

Every run starts from `torch.manual_seed(0)` before the build and steps the same micro-batch
of random tokens, as train_step does.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import zeroshard.engine as zs
import zeroshard.engine.lightning  # noqa: F401  (registers "zeroshard_stage_3")
from benchmarks._common import BenchModel, adamw, free, sync

# The Trainer's precision flags the benchmark runs (`--smoke`: fp32 on CPU).
Precision = Literal["32-true", "bf16-mixed"]

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Run:
    """One run's step times (after warm-up) and every step's loss."""

    name: str
    times: list[float]
    losses: list[float]

    @property
    def median_ms(self) -> float:
        """The median step, in milliseconds."""
        return statistics.median(self.times) * 1000


class _SameBatch(Dataset[Batch]):
    """`count` times the same micro-batch, already on the device (no copy, no collation)."""

    def __init__(self, batch: Batch, count: int) -> None:
        self.batch, self.count = batch, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> Batch:
        return self.batch


class _LossModule(pl.LightningModule):
    """The benchmarked model as a LightningModule: its loss is the training step."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: Batch, idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.model(*batch)
        return loss

    def configure_optimizers(self) -> Any:
        return adamw(self.parameters(), next(self.parameters()).device)


class _Clock(pl.Callback):
    """The time at the start of training and at the end of every batch, synchronized, and
    each batch's loss (kept on the device until the end)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.marks: list[float] = []
        self.losses: list[torch.Tensor] = []

    def on_train_start(self, trainer: Any, module: Any) -> None:
        sync(self.device)
        self.marks.append(time.perf_counter())

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, idx: int
    ) -> None:
        sync(self.device)
        self.marks.append(time.perf_counter())
        self.losses.append(outputs["loss"].detach())


def _build(bm: BenchModel, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return bm.build()


def fit(
    name: str,
    strategy: str,
    bm: BenchModel,
    batch: Batch,
    device: torch.device,
    *,
    precision: Precision,
    warmup: int,
    steps: int,
) -> Run:
    """Fit `warmup + steps` steps with the Trainer under `strategy`; time the last `steps`."""
    clock = _Clock(device)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator=device.type if device.type == "cpu" else "gpu",
        devices=1,
        precision=precision,
        max_steps=warmup + steps,
        callbacks=[clock],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
    )
    module = _LossModule(_build(bm, device))
    loader = DataLoader(_SameBatch(batch, warmup + steps), batch_size=None)
    trainer.fit(module, loader)
    marks = clock.marks
    times = [b - a for a, b in zip(marks[warmup:], marks[warmup + 1 :], strict=False)]
    losses = [float(loss) for loss in clock.losses]
    del trainer, module, clock
    free(device)
    return Run(name, times, losses)


def zs3_steps(
    bm: BenchModel,
    batch: Batch,
    device: torch.device,
    *,
    compute_dtype: str,
    warmup: int,
    steps: int,
) -> Run:
    """benchmarks/train_step's `zs3` on this model: time the last `steps` of `warmup + steps`."""
    model = _build(bm, device)
    model, opt = zs.initialize(
        model, adamw(model.parameters(), device), {"stage": 3, "compute_dtype": compute_dtype}
    )
    times, losses = [], []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss.detach())
    result = Run("zs3", times, [float(v) for v in losses])
    del model, opt, losses
    free(device)
    return result
