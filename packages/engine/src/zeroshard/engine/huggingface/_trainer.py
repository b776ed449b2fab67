"""`ZeroTrainer`: `transformers.Trainer` on zeroshard (needs the `hf` extra: transformers).

    from zeroshard.engine.huggingface import ZeroTrainer
    trainer = ZeroTrainer(model=model, args=training_args, zero_config={"stage": 3}, ...)
    trainer.train(); trainer.save_model()

or `ds_config="ds_config.json"` (a DeepSpeed config, "auto" values filled from the
`TrainingArguments` and the model) instead of `zero_config`.

The Trainer builds its optimizer as usual (from `TrainingArguments`); `ZeroTrainer` hands
it with the model to `zeroshard.engine.initialize` and tells accelerate that both are
prepared, so nothing wraps them in DistributedDataParallel: the engine reduces gradients.
See [Note: which Trainer hooks ZeroTrainer replaces].
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from accelerate.optimizer import AcceleratedOptimizer  # type: ignore[import-untyped]
from torch import nn
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from zeroshard.comm import Agreement
from zeroshard.engine.config._config import ZeroConfig, as_config
from zeroshard.engine.config._trainer_ds_config import trainer_ds_settings
from zeroshard.engine.huggingface._blocks import compile_blocks, model_blocks
from zeroshard.engine.runtime._optimizer import ZeroOptimizer
from zeroshard.engine.setup._initialize import initialize
from zeroshard.engine.state._checkpoint import load_checkpoint, save_checkpoint
from zeroshard.engine.state._masters import full_state_dict

__all__ = ["CHECKPOINT_SUBDIR", "ZeroTrainer", "rebuild_meta_buffers"]

CHECKPOINT_SUBDIR = "zeroshard"
"""Where a Trainer checkpoint (`checkpoint-N/`) keeps zeroshard's sharded model and optimizer."""

logger = logging.getLogger("zeroshard.engine.huggingface")

_SCHEDULER_NAME = "scheduler.pt"  # the Trainer's file name for the LR scheduler's state

# [Note: which Trainer hooks ZeroTrainer replaces]
# transformers (5.x) calls these where a DDP model would need something else:
# - create_optimizer: after the Trainer's own optimizer is built, `initialize` shards
#   model and optimizer; both get accelerate's `_is_accelerate_prepared` mark, which
#   makes `accelerator.prepare` return them unwrapped (no DDP, no autocast: the engine
#   owns reduction and precision).
# - _clip_grad_norm / _get_grad_norm: accelerate's clip sees empty or rank-local
#   gradients; the engine's global norm over all gradient shards is the true one.
# - save_model / _save_optimizer_and_scheduler / _load_from_checkpoint /
#   _load_optimizer_and_scheduler: checkpoints hold zeroshard's sharded state (any world
#   size on resume), save_model() writes the full weights gathered from the shards.
# - _load_best_model (load_best_model_at_end): from the best checkpoint's sharded state.
# The Trainer zeroes gradients with `model.zero_grad()`, which does not reach the
# engine's flat gradient shards: a callback zeroes them right after each optimizer step.


class _ZeroGradAfterStep(TrainerCallback):
    """Zero the engine's gradient shards after every optimizer step."""

    def __init__(self, optimizer: ZeroOptimizer) -> None:
        self.optimizer = optimizer

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.optimizer.zero_grad()


def _resolve_precision(config: ZeroConfig | Mapping[str, Any] | None, args: Any) -> ZeroConfig:
    """The engine config with `TrainingArguments.bf16` applied; fp16 and contradictions refused."""
    if args.fp16:
        raise ValueError(
            "ZeroTrainer: TrainingArguments(fp16=True) is not supported; use bf16=True, or "
            "zero_config compute_dtype='fp16' (the engine then scales the loss itself)"
        )
    if args.bf16 and isinstance(config, Mapping) and "compute_dtype" not in config:
        config = {**config, "compute_dtype": "bf16"}
    if args.bf16 and config is None:
        config = {"compute_dtype": "bf16"}
    cfg = as_config(config)
    if args.bf16 and cfg.precision.compute_dtype != torch.bfloat16:
        raise ValueError(
            f"ZeroTrainer: TrainingArguments(bf16=True) but zero_config computes in "
            f"{cfg.precision.compute_dtype}; make them agree"
        )
    return cfg


def _refuse_other_sharders(training_args: Any) -> None:
    # The Trainer would build DeepSpeed's engine from TrainingArguments(deepspeed=...) on
    # top of zeroshard's; and TrainingArguments has already set up DeepSpeed's plugin from
    # it, which cannot be undone cleanly. So the config has one way in: ds_config.
    if getattr(training_args, "deepspeed", None):
        raise ValueError(
            "ZeroTrainer: TrainingArguments(deepspeed=...) would start DeepSpeed; pass the "
            "config as ZeroTrainer(ds_config=...) and leave TrainingArguments.deepspeed unset"
        )
    # FSDP would wrap the model before zeroshard shards it (the Trainer prepares an FSDP
    # model before building the optimizer), or be dropped without a word where it does not.
    if getattr(training_args, "fsdp", None):
        raise ValueError(
            "ZeroTrainer: TrainingArguments(fsdp=...) asks accelerate to shard the model with "
            "FSDP, and zeroshard shards it already; leave fsdp unset (zero_config stage 3 is "
            "FSDP's full_shard)"
        )


def _refuse_undistributed(training_args: Any) -> None:
    # A Trainer that counts one process where the process group has several trains every
    # rank on the whole dataset (the epoch advances at 1/world the rate), and every rank
    # logs and writes the one output folder: wrong without an error. transformers sets
    # up distributed training on the CPU only with `use_cpu=True`; the arguments are the
    # user's, built before the Trainer, so they are not changed behind their back.
    ranks = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    counted = training_args.world_size
    if ranks > 1 and counted != ranks:
        mode = training_args.parallel_mode.value
        raise ValueError(
            f"ZeroTrainer: the process group has {ranks} ranks but TrainingArguments counts "
            f"{counted} (parallel_mode {mode!r}): every rank would train on the whole dataset "
            "and write the same output folder. On the CPU pass TrainingArguments("
            "use_cpu=True), which is how transformers trains on several CPU processes; on "
            "GPUs launch with torchrun (one process per GPU)"
        )


class ZeroTrainer(Trainer):
    """A `transformers.Trainer` whose model and optimizer are sharded by zeroshard.

    `zero_config` is a `ZeroConfig` or its dict (default: stage 2); or `ds_config`, a
    DeepSpeed config (dict or JSON path) read as DeepSpeed's Hugging Face integration reads
    it; `TrainingArguments(deepspeed=...)` is refused (it would start DeepSpeed).
    `TrainingArguments` keep their meaning: batch sizes, gradient accumulation,
    `max_grad_norm` (the global norm, logged as `grad_norm`), `bf16` (the engine's compute
    dtype), checkpoints and `resume_from_checkpoint` (at the same or another world size),
    `save_model()`; `torch_compile` compiles each block (see _blocks.py).
    """

    def __init__(
        self,
        *args: Any,
        zero_config: ZeroConfig | Mapping[str, Any] | None = None,
        ds_config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> None:
        if zero_config is not None and ds_config is not None:
            raise ValueError("ZeroTrainer: pass zero_config or ds_config, not both")
        _refuse_other_sharders(kwargs.get("args", args[1] if len(args) > 1 else None))
        super().__init__(*args, **kwargs)
        _refuse_undistributed(self.args)
        if ds_config is not None:
            settings = trainer_ds_settings(ds_config, self.args, self.model)
            if self.is_world_process_zero():
                for line in settings.not_honoured:
                    logger.info("ds_config %s", line)
            zero_config = settings.zero
        self.zero_config = _resolve_precision(zero_config, self.args)
        # A ready optimizer (`optimizers=(opt, None)`) is sharded like the Trainer's own.
        if self.optimizer is not None and len(self.optimizer.state) != 0:
            raise ValueError("ZeroTrainer: pass a fresh optimizer (no state yet)")
        # Found now, so that a model without blocks is refused before training starts.
        self._blocks_to_compile = model_blocks(self._module) if self.args.torch_compile else []

    @property
    def zero_optimizer(self) -> ZeroOptimizer:
        """The engine's optimizer (after training started)."""
        inner = getattr(self.optimizer, "optimizer", None)
        if not isinstance(inner, ZeroOptimizer):
            raise RuntimeError("ZeroTrainer: the engine is initialized when training starts")
        return inner

    def _engine_ready(self) -> bool:
        return isinstance(getattr(self.optimizer, "optimizer", None), ZeroOptimizer)

    @property
    def _module(self) -> nn.Module:
        if not isinstance(self.model, nn.Module):
            raise RuntimeError("ZeroTrainer needs a model (model_init is not supported)")
        return self.model

    def _scheduler(self) -> Any:
        if self.lr_scheduler is None:
            raise RuntimeError("ZeroTrainer: no LR scheduler to save or load yet")
        return self.lr_scheduler

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """Build the Trainer's optimizer, then shard it and the model with zeroshard."""
        if self._engine_ready() and self.optimizer is not None:
            return self.optimizer
        optimizer: torch.optim.Optimizer = super().create_optimizer(model)
        module, zopt = initialize(self._module, optimizer, self.zero_config)
        self.model = module
        if self._blocks_to_compile:
            compile_blocks(
                self._blocks_to_compile,
                backend=self.args.torch_compile_backend,
                mode=self.args.torch_compile_mode,
            )
            if self.is_world_process_zero():
                logger.info("torch_compile: %d blocks compiled", len(self._blocks_to_compile))
        # accelerate's wrapper (the Trainer reads its `step_was_skipped`), without moving
        # state; then accelerate's own mark of "already prepared", so that prepare()
        # leaves model and optimizer alone.
        wrapped: torch.optim.Optimizer = AcceleratedOptimizer(
            zopt, device_placement=False, scaler=None
        )
        module._is_accelerate_prepared = True  # type: ignore[assignment]
        wrapped._is_accelerate_prepared = True  # type: ignore[attr-defined]
        self.optimizer = wrapped
        self.add_callback(_ZeroGradAfterStep(zopt))
        return wrapped

    # -- gradient norm -------------------------------------------------------------------
    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return self.zero_optimizer.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: torch.Tensor | None = None) -> float:
        if grad_norm is None:
            # An infinite limit measures without clipping (the coefficient is 1).
            grad_norm = self.zero_optimizer.clip_grad_norm_(float("inf"))
        return float(grad_norm.item())

    # -- saving --------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the full weights (gathered from the shards) with `save_pretrained`.

        Collective: every rank must call it. Inside a Trainer checkpoint the sharded
        state is written instead (see `CHECKPOINT_SUBDIR`), unless `save_only_model`.
        """
        output_dir = output_dir if output_dir is not None else str(self.args.output_dir)
        if not self._engine_ready():
            super().save_model(output_dir, _internal_call)
            return
        if _internal_call and not self.args.save_only_model:
            # Replaces an existing checkpoint-N/ as the Trainer does (a resume into its own
            # output folder writes the steps after the checkpoint again).
            save_checkpoint(
                self._module,
                self.zero_optimizer,
                output_dir,
                step=self.state.global_step,
                tag=CHECKPOINT_SUBDIR,
                overwrite=True,
            )
            config = getattr(self._module, "config", None)
            if self.args.should_save and config is not None:
                config.save_pretrained(output_dir)
            return
        full = full_state_dict(self._module)
        self._save(output_dir, state_dict=full)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # The optimizer state went with the model into CHECKPOINT_SUBDIR (save_model).
        if self.args.should_save:
            torch.save(self._scheduler().state_dict(), os.path.join(output_dir, _SCHEDULER_NAME))

    # -- loading -------------------------------------------------------------------------
    def _load_from_checkpoint(
        self, resume_from_checkpoint: str, model: nn.Module | None = None
    ) -> None:
        # On resume the Trainer calls this before the engine exists; the sharded state is
        # then loaded in _load_optimizer_and_scheduler, once it does.
        if self._engine_ready():
            self._load_zeroshard(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        self._load_zeroshard(checkpoint)
        scheduler = os.path.join(checkpoint, _SCHEDULER_NAME)
        if _on_every_rank(scheduler, os.path.isfile):
            self._scheduler().load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        # The Trainer looks for model.safetensors in the best checkpoint; a ZeroTrainer
        # checkpoint holds the sharded state instead, and the Trainer would only warn and
        # keep the last weights. Model and optimizer come back, as DeepSpeed's do there.
        best = self.state.best_model_checkpoint
        if best is None or not _on_every_rank(os.path.join(best, CHECKPOINT_SUBDIR), os.path.isdir):
            super()._load_best_model()  # save_only_model: full weights, the Trainer's way
            return
        if self.is_world_process_zero():
            logger.info("loading the best model from %s", best)
        self._load_zeroshard(best)

    def _load_zeroshard(self, checkpoint: str) -> None:
        directory = os.path.join(checkpoint, CHECKPOINT_SUBDIR)
        if not _on_every_rank(directory, os.path.isdir):
            raise FileNotFoundError(
                f"ZeroTrainer: {checkpoint} holds no zeroshard state ({CHECKPOINT_SUBDIR}/): "
                "it was not written by ZeroTrainer (or with save_only_model=True)"
            )
        load_checkpoint(self._module, self.zero_optimizer, directory)


def _on_every_rank(path: str, is_there: Callable[[str], bool]) -> bool:
    """Whether `path` is there, agreed by every rank (one small all-gather).

    Ranks that see different files would take different paths (one loads, collectively,
    while another falls back or raises) and wait on each other forever, or load different
    LR schedules without a word: so where they disagree every rank raises, naming who sees
    what."""
    seen = [bool(row[0]) for row in Agreement(None).gather([int(is_there(path))], f"sees {path}")]
    if all(seen) or not any(seen):
        return seen[0]
    have = [r for r, s in enumerate(seen) if s]
    lack = [r for r, s in enumerate(seen) if not s]
    raise FileNotFoundError(
        f"ZeroTrainer: ranks {have} see {path} but ranks {lack} do not: every rank must "
        "read the checkpoint from one filesystem they all share"
    )


@torch.no_grad()
def rebuild_meta_buffers(model: nn.Module, device: torch.device | str = "cpu") -> list[str]:
    """Give a meta-device Hugging Face model's buffers storage and values; return their names.

    Non-persistent buffers (rotary `inv_freq`) are in no checkpoint: `initialize` refuses
    meta buffers, and loading cannot fill them. `model._init_weights` recomputes them; a
    non-persistent float buffer it leaves unset is an error naming it.
    """
    init = getattr(model, "_init_weights", None)
    if not callable(init):
        raise ValueError(f"{type(model).__name__} has no _init_weights: not a transformers model")
    rebuilt: list[str] = []
    for path, module in model.named_modules():
        names = [n for n, b in module.named_buffers(recurse=False) if b.is_meta]
        for name in names:
            meta = getattr(module, name)
            persistent = name not in module._non_persistent_buffers_set
            real = torch.empty(meta.shape, dtype=meta.dtype, device=device)
            if real.is_floating_point():
                real.fill_(math.nan)  # what _init_weights leaves unset stays visible
            module.register_buffer(name, real, persistent=persistent)
            rebuilt.append(f"{path}.{name}" if path else name)
        if names:
            init(module)
        unset = [
            n
            for n in names
            if n in module._non_persistent_buffers_set and getattr(module, n).isnan().any()
        ]
        if unset:
            raise ValueError(
                f"{type(model).__name__}._init_weights does not set the non-persistent "
                f"buffers {unset} of {path or 'the model'}: build the model on a real device"
            )
    return rebuilt
