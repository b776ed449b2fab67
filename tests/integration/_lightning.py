"""What the Lightning tests train: a small LightningModule, its data, a Trainer that records
what it logs, and the Fabric loop of the same model.

Every run starts from the same weights (seeded, or a deterministic `reset_parameters` for
`configure_model`), reads the same batches (Lightning's DistributedSampler, no shuffle)
and logs the loss averaged over ranks, so a strategy's logged figures can be compared
with `strategy="ddp"`'s number for number.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

D, HIDDEN, OUT = 8, 24, 4
SAMPLES, BATCH = 64, 4
# Stage 3 with every block a unit and nothing kept gathered, as on a large model.
UNITS = {"min_unit_params": 1, "persistence_threshold": 0}


class DetLinear(nn.Linear):
    """A Linear whose `reset_parameters` draws nothing: the same values built on the device
    (DDP) or materialized from the meta device unit by unit (zeroshard stage 3)."""

    def reset_parameters(self) -> None:
        with torch.no_grad():
            n = self.weight.numel()
            grid = torch.arange(n, dtype=torch.float32, device=self.weight.device)
            self.weight.copy_((torch.sin(grid * 0.37) * 0.4).view_as(self.weight))
            if self.bias is not None:
                self.bias.copy_(torch.cos(torch.arange(self.bias.numel()) * 0.91) * 0.1)


class Block(nn.Module):
    """A residual MLP block (a stage-3 unit)."""

    def __init__(self, linear: type[nn.Linear] = nn.Linear) -> None:
        super().__init__()
        self.up = linear(D, HIDDEN)
        self.down = linear(HIDDEN, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Net(pl.LightningModule):
    """Two blocks in a ModuleList, a head and a bare parameter (the root unit's), AdamW with
    a per-step LR schedule; `in_configure_model` builds the blocks in `configure_model`."""

    def __init__(self, in_configure_model: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, D))
        self.head = nn.Linear(D, OUT)
        self.in_configure_model = in_configure_model
        self.blocks: nn.ModuleList | None = None
        self.built_on: list[torch.device] = []
        if not in_configure_model:
            self.blocks = nn.ModuleList([Block() for _ in range(2)])

    def configure_model(self) -> None:
        if self.blocks is not None:
            return
        self.blocks = nn.ModuleList([Block(DetLinear) for _ in range(2)])
        self.built_on.append(self.blocks[0].up.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.scale
        assert self.blocks is not None
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x).float(), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x).float(), y), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x).float(), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=2e-2, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def dataset(samples: int = SAMPLES, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(samples, D, generator=g), torch.randn(samples, OUT, generator=g)
    )


def loader(samples: int = SAMPLES, seed: int = 1) -> DataLoader[Any]:
    return DataLoader(dataset(samples, seed), batch_size=BATCH)


class ManualNet(Net):
    """Net under manual optimization: backward, clip_gradients and the step by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        x, y = batch
        loss = F.mse_loss(self(x).float(), y)
        self.log("train_loss", loss, sync_dist=True)
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.3, gradient_clip_algorithm="norm")
        opt.step()
        opt.zero_grad()
        self.lr_schedulers().step()
        return loss


class Recorder(Logger):
    """Keeps every logged row: {step: {metric: value}}."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[int, dict[str, float]] = {}

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.setdefault(int(step or 0), {}).update(
            {k: float(v) for k, v in metrics.items() if k != "epoch"}
        )


class TorchGradNorm(Callback):
    """DDP's reference for the logged `grad_norm`: torch's total norm of the (averaged)
    gradients before clipping."""

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        pl_module.log("grad_norm", torch.nn.utils.get_total_norm(grads), on_step=True)


def trainer(
    strategy: Any, root: Path, *, steps: int, ckpt: bool = True, **kwargs: Any
) -> tuple[pl.Trainer, Recorder]:
    """A Trainer on this job's ranks with accumulation 2 and clipping that bites."""
    rec = Recorder()
    callbacks: list[Callback] = [TorchGradNorm()] if strategy == "ddp" else []
    if ckpt:
        callbacks.append(
            ModelCheckpoint(
                dirpath=root,
                filename="{step}",
                every_n_train_steps=2,
                save_top_k=2,
                monitor="train_loss",
                save_last=True,
            )
        )
    options: dict[str, Any] = {
        "enable_checkpointing": ckpt,
        "accumulate_grad_batches": 2,
        "gradient_clip_val": 0.3,
        "log_every_n_steps": 1,
        **kwargs,
    }
    t = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=dist.get_world_size(),
        max_steps=steps,
        logger=rec,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        **options,
    )
    return t, rec


def fit(strategy: Any, root: Path, *, steps: int = 6, ckpt_path: Any = None, **kwargs: Any) -> Any:
    """One fit (and a test after it): what it logged, and the module."""
    manual = kwargs.pop("manual", False)
    model = ManualNet() if manual else Net(kwargs.pop("in_configure_model", False))
    t, rec = trainer(strategy, root, steps=steps, **kwargs)
    t.fit(model, loader(), loader(16, seed=2), ckpt_path=ckpt_path)
    t.test(model, loader(16, seed=3), verbose=False)
    return rec.rows, model, t


def assert_rows_equal(got: dict[int, dict[str, float]], want: dict[int, dict[str, float]]) -> None:
    """The same metrics at the same steps, equal to fp32 reduction-order noise."""
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for step, metrics in want.items():
        assert sorted(got[step]) == sorted(metrics), (step, sorted(got[step]), sorted(metrics))
        for name, value in metrics.items():
            assert math.isclose(got[step][name], value, rel_tol=1e-6, abs_tol=1e-7), (
                f"step {step} {name}: {got[step][name]!r} != {value!r}"
            )


def fabric_run(
    strategy: Any,
    root: Path,
    *,
    steps: int,
    save_at: int | None = None,
    load: Path | None = None,
    empty_init: bool | None = None,
) -> list[float]:
    """A Fabric loop (accumulation 2, clipping, LR schedule): the global loss of each step.
    With `empty_init` set, the model (of DetLinear layers) is built in `fabric.init_module`."""
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=dist.get_world_size())
    fabric.launch()
    torch.manual_seed(0)
    if empty_init is None:
        model = nn.Sequential(Block(), Block(), nn.Linear(D, OUT))
    else:
        with fabric.init_module(empty_init=empty_init):
            model = nn.Sequential(Block(DetLinear), Block(DetLinear), DetLinear(D, OUT))
        on_meta = all(p.is_meta for p in model.parameters())
        assert on_meta == bool(empty_init and "zeroshard" in type(strategy).__name__.lower())
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    model, opt = fabric.setup(model, opt)
    data = fabric.setup_dataloaders(loader())
    state: dict[str, Any] = {"model": model, "optimizer": opt, "scheduler": sched, "step": 0}
    if load is not None:
        fabric.load(load, state)
    losses: list[float] = []
    batches = itertools.chain.from_iterable(data for _ in range(steps))
    for _ in range(2 * state["step"]):  # where the saved run stopped
        next(batches)
    while state["step"] < steps:
        total = torch.zeros(())
        for _ in range(2):
            x, y = next(batches)
            loss = F.mse_loss(model(x).float(), y) / 2
            fabric.backward(loss)
            total += loss.detach()
        fabric.clip_gradients(model, opt, max_norm=0.3)
        opt.step()
        opt.zero_grad()
        sched.step()
        state["step"] += 1
        losses.append(float(fabric.all_reduce(total, reduce_op="mean")))
        if state["step"] == save_at:
            fabric.save(root / "fabric.ckpt", state)
    return losses
