"""DeepSpeed's `zero_optimization`, `bf16` and `fp16` blocks -> our flat config keys.

"auto" values are resolved as DeepSpeed's Hugging Face integration does
(`transformers/integrations/deepspeed.py`, `HfTrainerDeepSpeedConfig`): bucket sizes and
the persistence threshold from the model's hidden size, bf16 / fp16 from the training
arguments; where that information is not given, the error names the key.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from zeroshard.engine.config._validate import (
    check_bool,
    check_int,
    parse_dtype,
    shown,
    unknown_keys_error,
)

AUTO = "auto"


@dataclass(frozen=True)
class AutoValues:
    """What DeepSpeed's "auto" values are filled from; None where it is not known (an
    "auto" key that needs it is then an error naming the key)."""

    hidden_size: int | None = None
    """The model's hidden size h: reduce_bucket_size = h*h, stage3_prefetch_bucket_size
    = int(0.9*h*h), stage3_param_persistence_threshold = 10*h (elements)."""

    bf16: bool | None = None
    """Fills `bf16.enabled` (the Trainer's `bf16`)."""

    fp16: bool | None = None
    """Fills `fp16.enabled` (the Trainer's `fp16`)."""

    micro_batch_size_per_gpu: int | None = None
    """Fills `train_micro_batch_size_per_gpu` (the Trainer's `per_device_train_batch_size`)."""

    gradient_accumulation_steps: int | None = None
    """Fills `gradient_accumulation_steps`."""

    world_size: int | None = None
    """With the two above, fills `train_batch_size` = world * micro batch * accumulation."""

    gradient_clipping: float | None = None
    """Fills `gradient_clipping` (the Trainer's `max_grad_norm`)."""

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "micro_batch_size_per_gpu",
            "gradient_accumulation_steps",
            "world_size",
        ):
            if getattr(self, name) is not None:
                check_int(f"AutoValues.{name}", getattr(self, name), minimum=1)
        for name in ("bf16", "fp16"):
            if getattr(self, name) is not None:
                check_bool(f"AutoValues.{name}", getattr(self, name))
        if self.gradient_clipping is not None:
            clipping = _number("AutoValues.gradient_clipping", self.gradient_clipping)
            if clipping < 0:
                raise ValueError(f"AutoValues.gradient_clipping must be >= 0, got {clipping}")


# zero_optimization keys we translate (DeepSpeed name -> our flat key); sizes in elements
# become bytes of the compute dtype.
_ELEMENTS_TO_BYTES = {
    "reduce_bucket_size": "reduce_bucket_bytes",
    "allgather_bucket_size": "allgather_bucket_bytes",
    "stage3_prefetch_bucket_size": "prefetch_bytes",
    "stage3_max_live_parameters": "max_live_bytes",
}
_TRANSLATED = (
    "stage",
    "overlap_comm",
    "stage3_param_persistence_threshold",
    "offload_optimizer",
    "offload_param",
    # Not in DeepSpeed's releases: the ZeRO-Offload paper's DPU, as its authors' DeepSpeed
    # branch spells it (beside `cpu_offload`).
    "delay_param_update",
    *_ELEMENTS_TO_BYTES,
)
# Keys whose DeepSpeed value is what zeroshard always does; any other value is refused.
_FIXED = {
    "contiguous_gradients": True,
    "reduce_scatter": True,
    "allgather_partitions": True,
    "cpu_offload": False,
    "zero_quantized_weights": False,
    "zero_quantized_gradients": False,
}
# Speed / memory knobs with no zeroshard equivalent: results do not depend on them.
_TUNING_ONLY = {
    "sub_group_size": "zeroshard does not split the optimizer step into sub-groups",
    "stage3_max_reuse_distance": "reuse is decided by prefetch_depth / persistence_threshold",
    "stage3_gather_16bit_weights_on_model_save": "full_state_dict always gathers full weights",
    "round_robin_gradients": "a DeepSpeed offload copy order zeroshard does not have",
    "elastic_checkpoint": "checkpoints load at any world size",
}
_UNSUPPORTED = (
    "ignore_unused_parameters",
    "load_from_fp32_weights",
    "zero_hpz_partition_size",
)
DEEPSPEED_ZERO_KEYS = (*_TRANSLATED, *_FIXED, *_TUNING_ONLY, *_UNSUPPORTED)
_HIDDEN_SIZE_RULES: dict[str, Callable[[int], int]] = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}
_BF16_KEYS = ("enabled", "bf16_master_weights_and_grads", "bf16_optimizer_states")
_FP16_KEYS = (
    "enabled",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "min_loss_scale",
    "hysteresis",
    "consecutive_hysteresis",
    "auto_cast",
)
PRECISION_BLOCKS = ("zero_optimization", "bf16", "fp16", "communication_data_type")


def is_deepspeed_dict(d: Mapping[str, Any]) -> bool:
    """Whether `d` is DeepSpeed's config or its `zero_optimization` dict rather than ours."""
    # DeepSpeed's offload_optimizer is a dict where ours is a bool.
    deepspeed_only = {"zero_optimization", *DEEPSPEED_ZERO_KEYS} - {"stage", "offload_optimizer"}
    return bool(set(d) & deepspeed_only) or isinstance(d.get("offload_optimizer"), Mapping)


def translate_deepspeed(
    d: Mapping[str, Any], auto: AutoValues | None = None, notes: list[str] | None = None
) -> dict[str, Any]:
    """Our flat keys from a DeepSpeed config (its precision and ZeRO blocks only) or from its
    `zero_optimization` dict. With `notes` None, keys zeroshard cannot honour are errors;
    otherwise each is described in `notes` and skipped."""
    auto = auto or AutoValues()
    if "zero_optimization" not in d:
        return _translate_zero(d, torch.float32, auto, notes)
    unknown = sorted(set(d) - set(PRECISION_BLOCKS))
    if unknown:
        raise ValueError(
            f"DeepSpeed config keys {unknown} are not part of a ZeroConfig; "
            f"zeroshard.engine.read_deepspeed_config reads a whole ds_config.json "
            f"(batch sizes, clipping) and lists what it cannot honour"
        )
    flat = _translate_precision(d, auto, notes)
    compute = flat.get("compute_dtype", torch.float32)
    zero = _block(d, "zero_optimization")
    return {**flat, **_translate_zero(zero, compute, auto, notes)}


def _block(d: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = d.get(key, {})
    if not isinstance(value, Mapping):
        raise ValueError(f"{key} must be a dict, got {shown(value)}")
    for k in value:
        if not isinstance(k, str):
            raise ValueError(f"{key} keys must be strings, got {shown(k)}")
    return value


def _not_honoured(path: str, why: str, notes: list[str] | None) -> None:
    if notes is None:
        raise ValueError(
            f"{path} has no zeroshard equivalent ({why}); remove it, or read the whole "
            "config with zeroshard.engine.read_deepspeed_config, which lists it as not honoured"
        )
    notes.append(f"{path}: not honoured ({why})")


def _enabled(block: str, d: Mapping[str, Any], wanted: bool | None) -> bool:
    value = _block(d, block).get("enabled", False)
    if value == AUTO:
        if wanted is None:
            raise ValueError(
                f"{block}.enabled is 'auto' and nothing says whether to use {block}: read the "
                f"config with read_deepspeed_config(config, AutoValues({block}=...)) (the "
                f"Trainer's `{block}` argument) or write true/false"
            )
        return wanted
    return check_bool(f"{block}.enabled", value)


def _translate_precision(
    d: Mapping[str, Any], auto: AutoValues, notes: list[str] | None
) -> dict[str, Any]:
    bf16 = _enabled("bf16", d, auto.bf16)
    fp16 = _enabled("fp16", d, auto.fp16)
    if bf16 and fp16:
        raise ValueError("DeepSpeed config enables both bf16 and fp16; choose one")
    bad = sorted(set(_block(d, "bf16")) - set(_BF16_KEYS))
    if bad:
        raise unknown_keys_error("bf16 keys", bad, _BF16_KEYS, path="bf16.")
    out: dict[str, Any] = {}
    if "communication_data_type" in d:
        out["reduce_dtype"] = parse_dtype(d["communication_data_type"], "communication_data_type")
    if bf16:
        out["compute_dtype"] = torch.bfloat16
    if _bf16_masters(_block(d, "bf16"), bf16):
        out["master_dtype"] = torch.bfloat16
    unknown = sorted(set(_block(d, "fp16")) - set(_FP16_KEYS))
    if unknown:
        raise unknown_keys_error("fp16 keys", unknown, _FP16_KEYS, path="fp16.")
    if fp16:
        out["compute_dtype"] = torch.float16
        out.update(_translate_fp16(_block(d, "fp16"), notes))
    return out


def _bf16_masters(b: Mapping[str, Any], bf16: bool) -> bool:
    """Whether DeepSpeed's bf16 block keeps masters, gradients and optimizer state in bf16
    (zeroshard's optimizer state follows the masters' dtype, so both keys or neither)."""
    masters = check_bool(
        "bf16.bf16_master_weights_and_grads", b.get("bf16_master_weights_and_grads", False)
    )
    states = check_bool("bf16.bf16_optimizer_states", b.get("bf16_optimizer_states", False))
    if states and not masters:
        raise ValueError(
            "bf16.bf16_optimizer_states needs bf16.bf16_master_weights_and_grads (as DeepSpeed)"
        )
    if masters and not states:
        raise ValueError(
            "bf16.bf16_master_weights_and_grads without bf16.bf16_optimizer_states keeps fp32 "
            "optimizer state beside bf16 masters, which DeepSpeed does only with its CPU Adam; "
            "zeroshard's optimizer state follows the masters: set bf16_optimizer_states too"
        )
    if masters and not bf16:
        raise ValueError("bf16.bf16_master_weights_and_grads needs bf16.enabled")
    return masters


def _translate_fp16(f: Mapping[str, Any], notes: list[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if _number("fp16.loss_scale", f.get("loss_scale", 0)) != 0:
        raise ValueError(
            "fp16.loss_scale: a static loss scale is not supported; zeroshard scales "
            "dynamically (set loss_scale to 0)"
        )
    if "initial_scale_power" in f:
        power = check_int("fp16.initial_scale_power", f["initial_scale_power"], minimum=0)
        out["initial_loss_scale"] = 2.0**power
    if "loss_scale_window" in f:
        out["loss_scale_window"] = f["loss_scale_window"]
    if "min_loss_scale" in f:
        out["min_loss_scale"] = f["min_loss_scale"]
    if f.get("hysteresis", 1) != 1:
        _not_honoured(
            "fp16.hysteresis", "zeroshard halves the scale at every overflowing step", notes
        )
    for key in ("consecutive_hysteresis", "auto_cast"):
        if f.get(key, False) is not False:
            _not_honoured(f"fp16.{key}", "not offered by zeroshard", notes)
    return out


def _number(path: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{path} must be a finite number, got {shown(value)}")
    return float(value)


def deepspeed_int(path: str, value: Any, minimum: int) -> int:
    """An int as DeepSpeed's JSON writes it: 5e8 (a float with an integral value) is 500000000."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        wanted = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(
            f"{path} must be {wanted} (or 'auto' where DeepSpeed allows it), got {shown(value)}"
        )
    return value


def _resolve_auto(z: Mapping[str, Any], auto: AutoValues) -> dict[str, Any]:
    out = dict(z)
    for key, rule in _HIDDEN_SIZE_RULES.items():
        if out.get(key) != AUTO:
            continue
        if auto.hidden_size is None:
            raise ValueError(
                f"zero_optimization.{key} is 'auto' and the model's hidden size is not known: "
                "read the config with read_deepspeed_config(config, AutoValues(hidden_size=...)) "
                "(DeepSpeed's Hugging Face integration fills it from model.config.hidden_size) "
                "or write a number"
            )
        out[key] = rule(auto.hidden_size)
    for key in _TRANSLATED:
        if out.get(key) == AUTO:
            raise ValueError(
                f"zero_optimization.{key} is 'auto', which only {sorted(_HIDDEN_SIZE_RULES)} "
                "may be (filled from the model's hidden size); write a value"
            )
    return out


def _translate_zero(
    z: Mapping[str, Any], compute: torch.dtype, auto: AutoValues, notes: list[str] | None
) -> dict[str, Any]:
    unknown = sorted(set(z) - set(DEEPSPEED_ZERO_KEYS))
    if unknown:
        raise unknown_keys_error(
            "DeepSpeed zero_optimization keys",
            unknown,
            DEEPSPEED_ZERO_KEYS,
            path="zero_optimization.",
        )
    for key in _UNSUPPORTED:
        if key in z:
            raise ValueError(f"zero_optimization.{key} is not supported by zeroshard; remove it")
    for key, value in _FIXED.items():
        if key in z and z[key] is not value:
            raise ValueError(
                f"zero_optimization.{key}={shown(z[key])} is not supported: zeroshard always "
                f"behaves as {key}={str(value).lower()}"
            )
    for key, why in _TUNING_ONLY.items():
        if key in z:
            _not_honoured(f"zero_optimization.{key}", why, notes)
    z = _resolve_auto(z, auto)
    out: dict[str, Any] = {}
    if "stage" in z:
        stage = z["stage"]
        if stage == 0 and not isinstance(stage, bool):
            raise ValueError(
                "zero_optimization.stage 0 is plain data parallelism (torch DDP); zeroshard "
                "offers stages 1, 2 and 3"
            )
        out["stage"] = stage  # checked exactly by ZeroConfig
    if "overlap_comm" in z:
        out["overlap"] = check_bool("zero_optimization.overlap_comm", z["overlap_comm"])
    for ds_key, key in _ELEMENTS_TO_BYTES.items():
        if ds_key in z:
            elements = deepspeed_int(f"zero_optimization.{ds_key}", z[ds_key], minimum=1)
            out[key] = elements * compute.itemsize
    if "stage3_param_persistence_threshold" in z:
        out["persistence_threshold"] = deepspeed_int(
            "zero_optimization.stage3_param_persistence_threshold",
            z["stage3_param_persistence_threshold"],
            minimum=0,
        )
    if "offload_optimizer" in z:
        on, pin, ratio = _offload("offload_optimizer", z["offload_optimizer"])
        out.update(offload_optimizer=on, offload_ratio=ratio if on and ratio is not None else 1.0)
        out["offload_pin_memory"] = pin
    if "offload_param" in z:
        on, pin, ratio = _offload("offload_param", z["offload_param"])
        if ratio is not None:
            raise ValueError(
                "zero_optimization.offload_param takes no ratio (offload_optimizer does)"
            )
        out["offload_params"] = on
        out["offload_pin_memory"] = out.get("offload_pin_memory", True) and pin
    if "delay_param_update" in z:
        out["offload_delay_param_update"] = check_bool(
            "zero_optimization.delay_param_update", z["delay_param_update"]
        )
    return out


_OFFLOAD_KEYS = ("device", "pin_memory", "ratio")


def _offload(key: str, value: Any) -> tuple[bool, bool, float | None]:
    """DeepSpeed's offload dict -> (on, pin_memory, ratio); 'nvme' and unknown keys refused."""
    path = f"zero_optimization.{key}"
    if not isinstance(value, Mapping):
        raise ValueError(f"{path} must be a dict such as {{'device': 'cpu'}}, got {shown(value)}")
    unknown = sorted(set(value) - set(_OFFLOAD_KEYS))
    if unknown:
        raise ValueError(f"unknown keys {unknown} in {path}; valid: {list(_OFFLOAD_KEYS)}")
    device = value.get("device", "none")
    if device == "nvme":
        raise ValueError(f"{path}.device='nvme' is not supported; use 'cpu'")
    if device not in ("cpu", "none"):
        raise ValueError(f"{path}.device must be 'cpu' or 'none', got {shown(device)}")
    pin = check_bool(f"{path}.pin_memory", value.get("pin_memory", True))
    ratio = value.get("ratio")
    if ratio is not None:
        ratio = _number(f"{path}.ratio", ratio)
    return device == "cpu", pin, ratio
