"""The policies a `ZeroConfig` is made of: small frozen dataclasses, one concern each.

Each checks its own fields exactly in `__post_init__` (type and range, naming the field as
`policy.field` and the flat key that sets it); checks across policies live in `ZeroConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zeroshard.engine.config._validate import (
    check_bool,
    check_int,
    check_names,
    check_positive_float,
    parse_dtype,
)


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which dtypes parameters compute in, gradients travel in and the masters (with their
    gradients and the optimizer's state) are kept in."""

    compute_dtype: torch.dtype = torch.float32
    """dtype of parameters in forward and backward: fp32, bf16 or fp16 (flat key
    `compute_dtype`; also 'fp32' / 'bf16' / 'fp16' or the long names)."""

    reduce_dtype: torch.dtype | None = None
    """dtype gradients are reduced in; None means `compute_dtype` (flat key `reduce_dtype`)."""

    master_dtype: torch.dtype = torch.float32
    """dtype of the master weights, their gradient shards and so the optimizer's state
    (torch's optimizers keep it in the parameter's dtype): fp32, or bf16 with bf16 compute,
    which halves those bytes and steps in bf16 as a pure-bf16 run does (DeepSpeed's
    `bf16.bf16_master_weights_and_grads` with `bf16_optimizer_states`; flat key
    `master_dtype`)."""

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "compute_dtype", parse_dtype(self.compute_dtype, "precision.compute_dtype")
        )
        if self.reduce_dtype is not None:
            object.__setattr__(
                self, "reduce_dtype", parse_dtype(self.reduce_dtype, "precision.reduce_dtype")
            )
        master = parse_dtype(self.master_dtype, "precision.master_dtype (master_dtype)")
        object.__setattr__(self, "master_dtype", master)
        if master not in (torch.float32, self.compute_dtype) or master == torch.float16:
            raise ValueError(
                f"precision.master_dtype (master_dtype) {master} needs compute_dtype bf16 "
                f"(got {self.compute_dtype}); masters are fp32, or bf16 with bf16 compute "
                "(fp16 masters would lose small updates and overflow)"
            )

    @property
    def grad_reduce_dtype(self) -> torch.dtype:
        """The dtype gradients travel in."""
        return self.reduce_dtype or self.compute_dtype


@dataclass(frozen=True)
class LossScalePolicy:
    """fp16 dynamic loss scaling: the scale halves on overflow and doubles after `window`
    steps without one (read only when the compute dtype is fp16)."""

    initial_scale: float = 2.0**16
    """Scale of the first step, a finite number > 0 (flat key `initial_loss_scale`)."""

    window: int = 1000
    """Steps without overflow before the scale doubles, >= 1 (flat key `loss_scale_window`)."""

    min_scale: float = 1.0
    """The scale never halves below this; finite, > 0 and <= `initial_scale`
    (flat key `min_loss_scale`)."""

    def __post_init__(self) -> None:
        initial = check_positive_float(
            "loss_scale.initial_scale (initial_loss_scale)", self.initial_scale
        )
        minimum = check_positive_float("loss_scale.min_scale (min_loss_scale)", self.min_scale)
        object.__setattr__(self, "initial_scale", initial)
        object.__setattr__(self, "min_scale", minimum)
        check_int("loss_scale.window (loss_scale_window)", self.window, minimum=1)
        if minimum > initial:
            raise ValueError(
                f"loss_scale.min_scale (min_loss_scale) {minimum} > loss_scale.initial_scale "
                f"(initial_loss_scale) {initial}"
            )


@dataclass(frozen=True)
class CommPolicy:
    """How gradients and updated parameters travel between ranks."""

    reduce_bucket_bytes: int = 64 * 2**20
    """Parameters are grouped into flat groups of about this many bytes (compute dtype);
    each group's gradients are reduced as one collective. A positive int."""

    allgather_bucket_bytes: int = 256 * 2**20
    """Stages 1/2: bytes of updated parameters all-gathered at once after a step (more
    waits for the oldest gathers; bounds their send buffers). A positive int."""

    overlap: bool = True
    """Reduce each group as soon as its gradients are ready, during backward; False reduces
    everything after backward (for debugging)."""

    max_inflight_reductions: int = 2
    """Older reductions are waited for beyond this many in flight, which bounds the memory
    held by gradient buckets. A positive int."""

    collective_timeout_s: float = 600.0
    """A collective that takes longer raises an error naming it; finite, > 0 seconds."""

    def __post_init__(self) -> None:
        for name in ("reduce_bucket_bytes", "allgather_bucket_bytes", "max_inflight_reductions"):
            check_int(f"comm.{name}", getattr(self, name), minimum=1)
        check_bool("comm.overlap", self.overlap)
        timeout = check_positive_float("comm.collective_timeout_s", self.collective_timeout_s)
        object.__setattr__(self, "collective_timeout_s", timeout)


@dataclass(frozen=True)
class Stage3Policy:
    """Stage 3: which modules are gathered as units and how far ahead they are fetched."""

    unit_modules: tuple[str, ...] = ()
    """Module names or class names gathered as units (may nest); empty means each block of
    a ModuleList/ModuleDict/Sequential with at least `min_unit_params` parameters, and the
    root for the rest."""

    leaf_modules: tuple[str, ...] = ()
    """Module names or class names fetched and released as one unit with nothing beneath
    them (an MoE layer whose experts run on some ranks only)."""

    min_unit_params: int = 100_000
    """Smallest default unit, in parameters (an int >= 0)."""

    leaf_params_per_module: int = 0
    """Also make a module a leaf when its parameters per descendant module fall under this
    (0: never)."""

    prefetch_depth: int = 1
    """Units gathered ahead of use, in forward and backward order (an int >= 0)."""

    prefetch_bytes: int = 2**30
    """Bytes of gathered units in flight ahead of use at most (a positive int)."""

    max_live_bytes: int = 2**40
    """No prefetch would push gathered bytes past this (a positive int)."""

    persistence_threshold: int = 100_000
    """Units with fewer parameters stay gathered for the whole step (like DeepSpeed's
    stage3_param_persistence_threshold; an int >= 0)."""

    def __post_init__(self) -> None:
        for name in ("unit_modules", "leaf_modules"):
            object.__setattr__(self, name, check_names(f"stage3.{name}", getattr(self, name)))
        for name in (
            "min_unit_params",
            "leaf_params_per_module",
            "prefetch_depth",
            "persistence_threshold",
        ):
            check_int(f"stage3.{name}", getattr(self, name), minimum=0)
        for name in ("prefetch_bytes", "max_live_bytes"):
            check_int(f"stage3.{name}", getattr(self, name), minimum=1)


@dataclass(frozen=True)
class OffloadPolicy:
    """CPU offload of optimizer state, master weights and (stage 3) parameter shards."""

    optimizer: bool = False
    """master weights and optimizer state live in CPU memory and the optimizer steps
    there; gradient shards go to the CPU during backward and updated compute-dtype shards
    come back to the device (stages 1-3; flat key `offload_optimizer`)."""

    ratio: float = 1.0
    """Share of the master/optimizer state put on the CPU, in (0, 1]; the rest stays on the
    device (needs `optimizer`; flat key `offload_ratio`)."""

    params: bool = False
    """Stage 3: the compute-dtype parameter shards of the offloaded part live in CPU memory
    too and are copied to the device just before their gather (needs `optimizer`; flat key
    `offload_params`)."""

    pin_memory: bool = True
    """Pin the host buffers that cross the bus (falls back to pageable memory with one
    warning where pinning fails; flat key `offload_pin_memory`)."""

    chunk_bytes: int = 64 * 2**20
    """Offloaded state is cut into chunks holding this many bytes of master per rank;
    host-to-device copies go chunk by chunk (flat key `offload_chunk_bytes`)."""

    delay_param_update: bool = False
    """ZeRO-Offload's delayed parameter update: `step()` starts the CPU step and returns,
    and the step runs while the next forward and backward compute, so they use the
    weights of the step before; the weights lag one step (stages 1/2; needs `optimizer`
    and torch's Adam/AdamW with fused=True; flat key `offload_delay_param_update`,
    DeepSpeed's `zero_optimization.delay_param_update`)."""

    compiled_step: bool = False
    """Step offloaded groups in one inductor-compiled pass per chunk (the gradient's
    upcast and Adam/AdamW fused, and with `params` the cast into the host shards) instead
    of torch's fused kernel after an upcast: faster, torch's arithmetic but not its bits
    (needs `optimizer`, torch's Adam/AdamW with fused=True and a C++ compiler for
    inductor; flat key `offload_compiled_step`)."""

    def __post_init__(self) -> None:
        check_bool("offload.optimizer (offload_optimizer)", self.optimizer)
        check_bool("offload.params (offload_params)", self.params)
        check_bool("offload.pin_memory (offload_pin_memory)", self.pin_memory)
        check_bool(
            "offload.delay_param_update (offload_delay_param_update)", self.delay_param_update
        )
        check_bool("offload.compiled_step (offload_compiled_step)", self.compiled_step)
        check_int("offload.chunk_bytes (offload_chunk_bytes)", self.chunk_bytes, minimum=1)
        ratio = check_positive_float("offload.ratio (offload_ratio)", self.ratio)
        if ratio > 1:
            raise ValueError(f"offload.ratio (offload_ratio) must be in (0, 1], got {ratio!r}")
        object.__setattr__(self, "ratio", ratio)
        if ratio != 1.0 and not self.optimizer:
            raise ValueError(
                f"offload.ratio={ratio} needs offload.optimizer=True (offload_optimizer)"
            )
        if self.delay_param_update and not self.optimizer:
            raise ValueError(
                "offload.delay_param_update (offload_delay_param_update) needs "
                "offload.optimizer=True: it delays the CPU step of offloaded optimizer state"
            )
        if self.compiled_step and not self.optimizer:
            raise ValueError(
                "offload.compiled_step (offload_compiled_step) needs offload.optimizer=True: "
                "it is the CPU step of offloaded optimizer state"
            )
        if self.params and not self.optimizer:
            raise ValueError(
                "offload.params (offload_params) needs offload.optimizer=True: the parameter "
                "shards are cast from the masters, which must be on the CPU too"
            )
