"""`ZeroConfig`: the typed, validated engine configuration, from our fields or DeepSpeed's."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TIERS = ("auto", "device", "distributed", "cpu")


def parse_dtype(value: str | torch.dtype, what: str) -> torch.dtype:
    """A dtype from 'bf16' / 'fp16' / 'fp32' (or long names) or a torch dtype."""
    if isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str) and value.lower() in _DTYPE_NAMES:
        dtype = _DTYPE_NAMES[value.lower()]
    else:
        raise ValueError(f"{what}: {value!r} is not a dtype; use one of 'fp32', 'bf16', 'fp16'")
    if dtype not in _COMPUTE_DTYPES:
        raise ValueError(f"{what}: {dtype} is not supported; use fp32, bf16 or fp16")
    return dtype


@dataclass(frozen=True)
class ZeroConfig:
    """How the engine shards and computes. Build from a dict with `ZeroConfig.from_dict`.

    Attributes:
        stage: 1 shards optimizer state and fp32 master weights; 2 also gradients; 3 also
            parameters, gathered unit by unit around their forward and backward.
        compute_dtype: dtype of parameters in forward/backward (master stays fp32).
        reduce_dtype: dtype gradients are reduced in; None means `compute_dtype`.
        reduce_bucket_bytes: parameters are grouped into flat groups of about this many
            bytes (compute dtype); each group's gradients are reduced as one collective.
        allgather_bucket_bytes: stages 1/2: bytes of updated parameters all-gathered at once
            after a step (more waits for the oldest gathers; bounds their send buffers).
        overlap: stage 2 reduces each group as soon as its gradients are ready, during
            backward; False reduces everything after backward (for debugging).
        max_inflight_reductions: stage 2 waits for older reductions beyond this many, which
            bounds the memory held by gradient buckets in flight.
        flatten_tier: where parameters are flattened: 'auto', 'device', 'distributed', 'cpu'.
        initial_loss_scale / loss_scale_window / min_loss_scale: fp16 dynamic loss scaling
            (the scale halves on overflow, doubles after `loss_scale_window` good steps).
        collective_timeout_s: a collective that takes longer raises an error naming it.
        unit_modules: stage 3: module names or class names gathered as units (may nest);
            empty means each block of a ModuleList/ModuleDict/Sequential with at least
            `min_unit_params` parameters, and the root for the rest.
        leaf_modules: stage 3: module names or class names fetched and released as one unit
            with nothing beneath them (an MoE layer whose experts run on some ranks only).
        leaf_params_per_module: stage 3: also make a module a leaf when its parameters per
            descendant module fall under this (0: never).
        prefetch_depth: stage 3: units gathered ahead of use, in forward and backward order.
        prefetch_bytes: stage 3: bytes of gathered units in flight ahead of use at most.
        max_live_bytes: stage 3: no prefetch would push gathered bytes past this.
        persistence_threshold: stage 3: units with fewer parameters stay gathered for the
            whole step (like DeepSpeed's stage3_param_persistence_threshold).
        shard_group_size: hybrid sharding: shard over groups of this many consecutive ranks
            and replicate across the groups (gradients are reduce-scattered within a group,
            then all-reduced across groups); None shards over all ranks.
        offload_optimizer: fp32 master weights and optimizer state live in CPU memory and
            the optimizer steps there; gradient shards go to the CPU during backward and
            updated compute-dtype shards come back to the device (stages 1-3).
        offload_ratio: share of the master/optimizer state put on the CPU, in (0, 1]; the
            rest stays on the device (needs `offload_optimizer`).
        offload_params: stage 3: the compute-dtype parameter shards of the offloaded part
            live in CPU memory too and are copied to the device just before their gather.
        offload_pin_memory: pin the host buffers that cross the bus (falls back to pageable
            memory with one warning where pinning fails).
        offload_chunk_bytes: offloaded state is cut into chunks holding this many bytes of
            fp32 master per rank; host-to-device copies go chunk by chunk.
    """

    stage: int = 2
    compute_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype | None = None
    reduce_bucket_bytes: int = 64 * 2**20
    allgather_bucket_bytes: int = 256 * 2**20
    overlap: bool = True
    max_inflight_reductions: int = 2
    flatten_tier: str = "auto"
    initial_loss_scale: float = 2.0**16
    loss_scale_window: int = 1000
    min_loss_scale: float = 1.0
    collective_timeout_s: float = 600.0
    unit_modules: tuple[str, ...] = ()
    leaf_modules: tuple[str, ...] = ()
    min_unit_params: int = 100_000
    leaf_params_per_module: int = 0
    prefetch_depth: int = 1
    prefetch_bytes: int = 2**30
    max_live_bytes: int = 2**40
    persistence_threshold: int = 100_000
    shard_group_size: int | None = None
    offload_optimizer: bool = False
    offload_ratio: float = 1.0
    offload_params: bool = False
    offload_pin_memory: bool = True
    offload_chunk_bytes: int = 64 * 2**20

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, got {self.stage!r}")
        for name in ("unit_modules", "leaf_modules"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{name} must be a list of module or class names, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        for name in (
            "min_unit_params",
            "leaf_params_per_module",
            "prefetch_depth",
            "persistence_threshold",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        object.__setattr__(self, "compute_dtype", parse_dtype(self.compute_dtype, "compute_dtype"))
        if self.reduce_dtype is not None:
            object.__setattr__(self, "reduce_dtype", parse_dtype(self.reduce_dtype, "reduce_dtype"))
        for name in (
            "reduce_bucket_bytes",
            "allgather_bucket_bytes",
            "max_inflight_reductions",
            "prefetch_bytes",
            "max_live_bytes",
            "offload_chunk_bytes",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.shard_group_size is not None and (
            not isinstance(self.shard_group_size, int) or self.shard_group_size < 1
        ):
            raise ValueError(
                f"shard_group_size must be a positive integer or None, "
                f"got {self.shard_group_size!r}"
            )
        if self.flatten_tier not in _TIERS:
            raise ValueError(f"flatten_tier must be one of {_TIERS}, got {self.flatten_tier!r}")
        if not self.initial_loss_scale > 0 or not self.min_loss_scale > 0:
            raise ValueError("initial_loss_scale and min_loss_scale must be positive")
        if self.min_loss_scale > self.initial_loss_scale:
            raise ValueError(
                f"min_loss_scale {self.min_loss_scale} > initial_loss_scale "
                f"{self.initial_loss_scale}"
            )
        if self.loss_scale_window < 1:
            raise ValueError(f"loss_scale_window must be >= 1, got {self.loss_scale_window}")
        if not self.collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s must be > 0, got {self.collective_timeout_s}")
        self._check_offload()

    def _check_offload(self) -> None:
        for name in ("offload_optimizer", "offload_params", "offload_pin_memory"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        ratio = self.offload_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(f"offload_ratio must be in (0, 1], got {ratio!r}")
        if ratio != 1.0 and not self.offload_optimizer:
            raise ValueError(f"offload_ratio={ratio} needs offload_optimizer=True")
        if self.offload_params and self.stage != 3:
            raise ValueError(
                f"offload_params needs stage 3 (parameters are whole on every rank at stage "
                f"{self.stage}); use offload_optimizer to offload optimizer state"
            )
        if self.offload_params and not self.offload_optimizer:
            raise ValueError(
                "offload_params needs offload_optimizer=True: the parameter shards are cast "
                "from the fp32 masters, which must be on the CPU too"
            )

    @property
    def grad_reduce_dtype(self) -> torch.dtype:
        """The dtype gradients travel in."""
        return self.reduce_dtype or self.compute_dtype

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> ZeroConfig:
        """From our field names, a DeepSpeed `zero_optimization` dict, or a DeepSpeed config
        holding one; unknown keys are a ValueError listing the valid ones."""
        if "zero_optimization" in d:
            return _from_deepspeed_config(d)
        ours = {f.name for f in fields(ZeroConfig)}
        deepspeed_only = (set(_DEEPSPEED_ZERO_KEYS) | set(_DEEPSPEED_UNSUPPORTED)) - ours
        # DeepSpeed's offload_optimizer is a dict where ours is a bool.
        if set(d) & deepspeed_only or isinstance(d.get("offload_optimizer"), Mapping):
            return _from_deepspeed_zero(d, {})
        unknown = sorted(set(d) - ours)
        if unknown:
            raise ValueError(
                f"unknown ZeroConfig keys {unknown}; valid keys: {sorted(ours)} "
                f"(or DeepSpeed's zero_optimization keys: {sorted(_DEEPSPEED_ZERO_KEYS)})"
            )
        return ZeroConfig(**d)

    def replace(self, **changes: Any) -> ZeroConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


# DeepSpeed's zero_optimization keys we translate, and those accepted because our
# engine always behaves that way (they have no setting to change here).
_DEEPSPEED_ZERO_KEYS: dict[str, str] = {
    "stage": "stage",
    "reduce_bucket_size": "reduce_bucket_bytes",
    "allgather_bucket_size": "allgather_bucket_bytes",
    "overlap_comm": "overlap",
    "contiguous_gradients": "",
    "reduce_scatter": "",
    "allgather_partitions": "",
    "stage3_prefetch_bucket_size": "prefetch_bytes",
    "stage3_param_persistence_threshold": "persistence_threshold",
    "stage3_max_live_parameters": "max_live_bytes",
    "offload_optimizer": "offload_optimizer",
    "offload_param": "offload_params",
}
_DEEPSPEED_ALWAYS_TRUE = ("contiguous_gradients", "reduce_scatter", "allgather_partitions")
# DeepSpeed zero_optimization keys zeroshard does not offer (yet): named so the error says
# "unsupported" rather than "unknown".
_DEEPSPEED_UNSUPPORTED = (
    "cpu_offload",
    "sub_group_size",
    "round_robin_gradients",
    "elastic_checkpoint",
    "ignore_unused_parameters",
    "load_from_fp32_weights",
    "zero_hpz_partition_size",
    "zero_quantized_weights",
    "zero_quantized_gradients",
    "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save",
)
_DEEPSPEED_TOP_KEYS = ("zero_optimization", "bf16", "fp16")


def _from_deepspeed_zero(z: Mapping[str, Any], extra: dict[str, Any]) -> ZeroConfig:
    unknown = sorted(set(z) - set(_DEEPSPEED_ZERO_KEYS))
    if unknown:
        raise ValueError(
            f"unsupported DeepSpeed zero_optimization keys {unknown}; "
            f"supported: {sorted(_DEEPSPEED_ZERO_KEYS)}"
        )
    for key in _DEEPSPEED_ALWAYS_TRUE:
        if key in z and not z[key]:
            raise ValueError(
                f"zero_optimization.{key}=false is not supported: zeroshard always does it"
            )
    out = dict(extra)
    if "stage" in z:
        out["stage"] = z["stage"]
    if "overlap_comm" in z:
        out["overlap"] = bool(z["overlap_comm"])
    compute = out.get("compute_dtype", torch.float32)
    # DeepSpeed's bucket sizes count elements; ours count bytes.
    itemsize = parse_dtype(compute, "compute_dtype").itemsize
    for ds_key, key in (
        ("reduce_bucket_size", "reduce_bucket_bytes"),
        ("allgather_bucket_size", "allgather_bucket_bytes"),
        ("stage3_prefetch_bucket_size", "prefetch_bytes"),
        ("stage3_max_live_parameters", "max_live_bytes"),
    ):
        if ds_key in z:
            out[key] = int(z[ds_key]) * itemsize
    if "stage3_param_persistence_threshold" in z:
        out["persistence_threshold"] = int(z["stage3_param_persistence_threshold"])
    if "offload_optimizer" in z:
        on, pin, ratio = _deepspeed_offload("offload_optimizer", z["offload_optimizer"])
        out.update(offload_optimizer=on, offload_ratio=ratio if on else 1.0)
        out["offload_pin_memory"] = pin
    if "offload_param" in z:
        on, pin, ratio = _deepspeed_offload("offload_param", z["offload_param"])
        if ratio != 1.0:
            raise ValueError(
                "zero_optimization.offload_param takes no ratio (offload_optimizer does)"
            )
        out["offload_params"] = on
        out["offload_pin_memory"] = out.get("offload_pin_memory", True) and pin
    return ZeroConfig(**out)


_DEEPSPEED_OFFLOAD_KEYS = ("device", "pin_memory", "ratio")


def _deepspeed_offload(key: str, value: Any) -> tuple[bool, bool, float]:
    """DeepSpeed's offload dict -> (on, pin_memory, ratio); 'nvme' and unknown keys refused."""
    if not isinstance(value, Mapping):
        raise ValueError(f"zero_optimization.{key} must be a dict such as {{'device': 'cpu'}}")
    unknown = sorted(set(value) - set(_DEEPSPEED_OFFLOAD_KEYS))
    if unknown:
        raise ValueError(
            f"unknown keys {unknown} in zero_optimization.{key}; "
            f"valid: {list(_DEEPSPEED_OFFLOAD_KEYS)}"
        )
    device = str(value.get("device", "none")).lower()
    if device == "nvme":
        raise ValueError(f"zero_optimization.{key}.device='nvme' is not supported; use 'cpu'")
    if device not in ("cpu", "none"):
        raise ValueError(f"zero_optimization.{key}.device must be 'cpu' or 'none', got {device!r}")
    return device == "cpu", bool(value.get("pin_memory", True)), float(value.get("ratio", 1.0))


def _from_deepspeed_config(d: Mapping[str, Any]) -> ZeroConfig:
    unknown = sorted(set(d) - set(_DEEPSPEED_TOP_KEYS))
    if unknown:
        raise ValueError(
            f"DeepSpeed config keys {unknown} are not zeroshard's to read: pass only "
            f"{list(_DEEPSPEED_TOP_KEYS)} (batch sizes, optimizer and clipping stay in your script)"
        )
    bf16 = bool(d.get("bf16", {}).get("enabled", False))
    fp16_cfg = d.get("fp16", {})
    fp16 = bool(fp16_cfg.get("enabled", False))
    if bf16 and fp16:
        raise ValueError("DeepSpeed config enables both bf16 and fp16; choose one")
    extra: dict[str, Any] = {}
    if bf16:
        extra["compute_dtype"] = torch.bfloat16
    if fp16:
        extra["compute_dtype"] = torch.float16
        if fp16_cfg.get("loss_scale", 0):
            raise ValueError(
                "a static fp16 loss_scale is not supported; zeroshard scales dynamically"
            )
        if "initial_scale_power" in fp16_cfg:
            extra["initial_loss_scale"] = 2.0 ** int(fp16_cfg["initial_scale_power"])
        if "loss_scale_window" in fp16_cfg:
            extra["loss_scale_window"] = int(fp16_cfg["loss_scale_window"])
        if "min_loss_scale" in fp16_cfg:
            extra["min_loss_scale"] = float(fp16_cfg["min_loss_scale"])
    return _from_deepspeed_zero(d["zero_optimization"], extra)


def as_config(config: ZeroConfig | Mapping[str, Any] | None) -> ZeroConfig:
    """Accept a ZeroConfig, a dict (ours or DeepSpeed's) or None (defaults)."""
    if config is None:
        return ZeroConfig()
    if isinstance(config, ZeroConfig):
        return config
    if isinstance(config, Mapping):
        return ZeroConfig.from_dict(config)
    raise TypeError(f"config must be a ZeroConfig or a dict, got {type(config).__name__}")
