"""`ZeroConfig`: the typed, validated engine configuration, grouped into policies.

Built in Python from policies, or from a dict: our flat keys (`{"stage": 3,
"compute_dtype": "bf16"}`), policies as nested dicts (`{"precision": {...}}`), or DeepSpeed's
`zero_optimization` dict (translated by `_deepspeed_translate`).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from zeroshard.engine.config._deepspeed_translate import (
    DEEPSPEED_ZERO_KEYS,
    PRECISION_BLOCKS,
    is_deepspeed_dict,
    translate_deepspeed,
)
from zeroshard.engine.config._policies import (
    CommPolicy,
    LossScalePolicy,
    OffloadPolicy,
    PrecisionPolicy,
    Stage3Policy,
)
from zeroshard.engine.config._validate import (
    check_choice,
    check_int,
    dtype_name,
    shown,
    unknown_keys_error,
)

_TIERS = ("auto", "device", "distributed", "cpu")
_POLICIES: dict[str, type[Any]] = {
    "precision": PrecisionPolicy,
    "loss_scale": LossScalePolicy,
    "comm": CommPolicy,
    "stage3": Stage3Policy,
    "offload": OffloadPolicy,
}
_TOP_LEVEL = ("stage", "shard_group_size", "flatten_tier")
# Flat key -> (policy, field); the policy is "" for the fields of ZeroConfig itself.
FLAT_KEYS: dict[str, tuple[str, str]] = {
    **{key: ("", key) for key in _TOP_LEVEL},
    "compute_dtype": ("precision", "compute_dtype"),
    "reduce_dtype": ("precision", "reduce_dtype"),
    "master_dtype": ("precision", "master_dtype"),
    "initial_loss_scale": ("loss_scale", "initial_scale"),
    "loss_scale_window": ("loss_scale", "window"),
    "min_loss_scale": ("loss_scale", "min_scale"),
    **{f.name: ("comm", f.name) for f in fields(CommPolicy)},
    **{f.name: ("stage3", f.name) for f in fields(Stage3Policy)},
    **{f"offload_{f.name}": ("offload", f.name) for f in fields(OffloadPolicy)},
}


@dataclass(frozen=True)
class ZeroConfig:
    """How the engine shards and computes: the stage and the shard group, and one policy per
    concern. Build from a dict with `ZeroConfig.from_dict`; `to_dict` gives the flat keys."""

    stage: int = 2
    """1 shards optimizer state and master weights; 2 also gradients; 3 also
    parameters, gathered unit by unit around their forward and backward."""

    shard_group_size: int | None = None
    """Hybrid sharding: shard over groups of this many consecutive ranks and replicate
    across the groups (gradients are reduce-scattered within a group, then all-reduced
    across groups); None shards over all ranks."""

    flatten_tier: str = "auto"
    """Where parameters are flattened: 'auto', 'device', 'distributed' or 'cpu'."""

    precision: PrecisionPolicy = field(default_factory=PrecisionPolicy)
    """Compute, gradient-reduce and master dtypes."""

    loss_scale: LossScalePolicy = field(default_factory=LossScalePolicy)
    """fp16 dynamic loss scaling."""

    comm: CommPolicy = field(default_factory=CommPolicy)
    """Gradient buckets, overlap and the collective timeout."""

    stage3: Stage3Policy = field(default_factory=Stage3Policy)
    """Stage 3 units, prefetch and persistence."""

    offload: OffloadPolicy = field(default_factory=OffloadPolicy)
    """CPU offload of optimizer state, masters and parameters."""

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3 (an int), got {shown(self.stage)}")
        check_int("stage", self.stage, minimum=1)  # 2.0 == 2, yet a float is no stage
        if self.shard_group_size is not None:
            check_int("shard_group_size", self.shard_group_size, minimum=1)
        check_choice("flatten_tier", self.flatten_tier, _TIERS)
        for name, policy in _POLICIES.items():
            value = getattr(self, name)
            if not isinstance(value, policy):
                raise ValueError(
                    f"{name} must be a {policy.__name__}, got {shown(value)} "
                    "(ZeroConfig.from_dict reads dicts)"
                )
        if self.offload.params and self.stage != 3:
            raise ValueError(
                f"offload.params (offload_params) needs stage 3 (parameters are whole on every "
                f"rank at stage {self.stage}); use offload_optimizer to offload optimizer state"
            )
        if self.offload.delay_param_update and self.stage == 3:
            raise ValueError(
                "offload.delay_param_update (offload_delay_param_update) needs stage 1 or 2: "
                "at stage 3 the next forward gathers the shards the delayed step rewrites"
            )

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> ZeroConfig:
        """From our flat keys (or policies as nested dicts), a DeepSpeed `zero_optimization`
        dict, or a DeepSpeed config holding one with its `bf16` / `fp16` blocks."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a config must be a dict, got {shown(d)}")
        _check_string_keys(d, "config")
        if is_deepspeed_dict(d):
            d = _read_deepspeed(d)
        return _build(_split_flat(d))

    def to_dict(self) -> dict[str, Any]:
        """The flat keys with JSON-ready values; `from_dict(cfg.to_dict()) == cfg`."""
        out: dict[str, Any] = {}
        for key, (policy, name) in FLAT_KEYS.items():
            value = getattr(getattr(self, policy) if policy else self, name)
            if key in ("compute_dtype", "reduce_dtype", "master_dtype") and value is not None:
                value = dtype_name(value)
            out[key] = list(value) if isinstance(value, tuple) else value
        return out

    def replace(self, **changes: Any) -> ZeroConfig:
        """A copy with some fields changed, by flat key or policy name (validated again)."""
        _check_string_keys(changes, "replace()")
        parts = _split_flat(changes)
        current = {name: getattr(self, name) for name in (*_TOP_LEVEL, *_POLICIES)}
        parts[""] = {**current, **parts.get("", {})}
        return _build(parts)


def _check_string_keys(d: Mapping[Any, Any], where: str) -> None:
    for key in d:
        if not isinstance(key, str):
            raise ValueError(f"{where} keys must be strings, got {shown(key)}")


def _read_deepspeed(d: Mapping[str, Any]) -> dict[str, Any]:
    """A dict read as DeepSpeed's, translated to our flat keys. One dict is read in one
    spelling: with our own keys beside DeepSpeed's it is refused, and an error of the
    translation says which keys made it DeepSpeed's and which of ours each resembles
    (DeepSpeed's `offload_param` beside our `offload_params`)."""
    ours = set(FLAT_KEYS) | set(_POLICIES)
    theirs = {"zero_optimization", *DEEPSPEED_ZERO_KEYS, *PRECISION_BLOCKS}
    # The shared names: "stage" means the same in both; "offload_optimizer" is ours when
    # a bool and DeepSpeed's when a dict.
    why = sorted(k for k in d if k in theirs and k not in ours)
    if isinstance(d.get("offload_optimizer"), Mapping):
        why.append("offload_optimizer (a dict)")
    hints = ""
    for key in why:
        close = difflib.get_close_matches(key, sorted(ours - theirs), n=1, cutoff=0.8)
        if close:
            hints += f"; {key!r} is DeepSpeed's key: did you mean zeroshard's {close[0]!r}?"
    mixed = sorted(k for k in d if k in ours and k not in theirs)
    if mixed:
        raise ValueError(
            f"config mixes zeroshard keys {mixed} with DeepSpeed keys "
            f"{why}: a dict is read as one or the other{hints}"
        )
    try:
        return translate_deepspeed(d)
    except ValueError as e:
        if not hints:
            raise
        raise ValueError(f"{e} (read as DeepSpeed's config because of {why}{hints})") from None


def _split_flat(d: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Flat keys and nested policy dicts -> {policy ("" for top level): {field: value}}."""
    unknown = sorted(set(d) - set(FLAT_KEYS) - set(_POLICIES))
    if unknown:
        raise unknown_keys_error(
            "ZeroConfig keys",
            unknown,
            [*FLAT_KEYS, *_POLICIES],
            other=("DeepSpeed's zero_optimization keys", DEEPSPEED_ZERO_KEYS),
        )
    out: dict[str, dict[str, Any]] = {}
    for key, value in d.items():
        if key in _POLICIES and isinstance(value, Mapping):
            _check_string_keys(value, key)
            names = {f.name for f in fields(_POLICIES[key])}
            bad = sorted(set(value) - names)
            if bad:
                raise unknown_keys_error(f"{key} keys", bad, names, path=f"{key}.")
            targets = [(key, name, f"{key}.{name}") for name in value]
            values = list(value.values())
        elif key in _POLICIES:
            out.setdefault("", {})[key] = value  # a policy object: checked by ZeroConfig
            continue
        else:
            targets, values = [(*FLAT_KEYS[key], key)], [value]
        for (policy, name, spelled), v in zip(targets, values, strict=True):
            fields_of = out.setdefault(policy, {})
            if name in fields_of:
                raise ValueError(f"{spelled} is set twice (as a flat key and in {policy!r})")
            fields_of[name] = v
    return out


def _build(parts: Mapping[str, Mapping[str, Any]]) -> ZeroConfig:
    """A ZeroConfig from {policy: {field: value}}; "" holds ZeroConfig's own fields, which
    may be whole policies that the other entries then change."""
    top = dict(parts.get("", {}))
    for policy, cls in _POLICIES.items():
        changes = parts.get(policy)
        if not changes:
            continue
        base = top.get(policy, cls())
        if not isinstance(base, cls):
            raise ValueError(f"{policy} must be a {cls.__name__} or a dict, got {shown(base)}")
        top[policy] = dataclasses.replace(base, **changes)
    return ZeroConfig(**top)


def as_config(config: ZeroConfig | Mapping[str, Any] | None) -> ZeroConfig:
    """Accept a ZeroConfig, a dict (ours or DeepSpeed's) or None (defaults)."""
    if config is None:
        return ZeroConfig()
    if isinstance(config, ZeroConfig):
        return config
    if isinstance(config, Mapping):
        return ZeroConfig.from_dict(config)
    raise TypeError(f"config must be a ZeroConfig or a dict, got {type(config).__name__}")
