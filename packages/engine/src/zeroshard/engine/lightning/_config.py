"""The strategies' engine config: a ZeroConfig, its dict or a DeepSpeed config, with what
Lightning decides applied to it (precision; the Trainer's accumulation and clipping).

A DeepSpeed config is a `ds_config.json` path or a dict with DeepSpeed's top-level keys. As
under Lightning's DeepSpeedStrategy, the loop's own knobs win: the batch-size keys are not
read (the DataLoader decides), `gradient_accumulation_steps` and `gradient_clipping` must
agree with `Trainer(accumulate_grad_batches=..., gradient_clip_val=...)` or be "auto"
(under Fabric, where the user's loop accumulates and clips, they are not read), and
`bf16.enabled` / `fp16.enabled` must agree with the precision flag or be "auto".
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import torch

from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.config._deepspeed_config import read_deepspeed_config
from zeroshard.engine.config._deepspeed_translate import AutoValues
from zeroshard.engine.lightning._precision import compute_dtype_of

ConfigSource: TypeAlias = ZeroConfig | Mapping[str, Any] | str | os.PathLike[str] | None
"""What `config=` takes: a ZeroConfig or its dict (None: stage 2 defaults), or a DeepSpeed
config (a dict or a JSON file)."""

log = logging.getLogger("zeroshard.engine.lightning")

_AUTO = "auto"
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu")
_LOOP_KEYS = ("gradient_accumulation_steps", "gradient_clipping")
# Top-level keys that only a whole DeepSpeed config has (a ZeroConfig dict has none).
_DEEPSPEED_ONLY = ("zero_optimization", "bf16", "fp16", *_BATCH_KEYS, *_LOOP_KEYS)


@dataclass(frozen=True)
class LoopSettings:
    """What Lightning decides that a config may also say."""

    precision: str
    """The precision flag (`Trainer(precision=...)`)."""

    accumulate_grad_batches: int | None
    """The Trainer's accumulation; None under Fabric (the user's loop accumulates)."""

    gradient_clip_val: float | None
    """The Trainer's clipping (0: none); None under Fabric (`fabric.clip_gradients`)."""

    hidden_size: int | None = None
    """The model's hidden size, for DeepSpeed's "auto" bucket sizes."""


def engine_config(source: ConfigSource, loop: LoopSettings, *, rank_zero: bool) -> ZeroConfig:
    """The ZeroConfig to initialize with; on rank 0 (`rank_zero`) each DeepSpeed key not
    honoured is logged. ValueError naming the key where the config contradicts the loop."""
    cfg, notes = resolve_config(source, loop)
    if rank_zero:
        for line in notes:
            log.info("DeepSpeed config %s", line)
    return cfg


def resolve_config(source: ConfigSource, loop: LoopSettings) -> tuple[ZeroConfig, list[str]]:
    """The ZeroConfig to initialize with, and one line per DeepSpeed key not honoured.

    ValueError naming the key where the config contradicts the loop's settings."""
    wanted = compute_dtype_of(loop.precision)
    if isinstance(source, (str, os.PathLike)) or (
        isinstance(source, Mapping) and set(source) & set(_DEEPSPEED_ONLY)
    ):
        cfg, notes = _from_deepspeed(source, loop, wanted)
    elif isinstance(source, Mapping):
        cfg, notes = ZeroConfig.from_dict(source), []
        policy = source.get("precision")
        named = "compute_dtype" in source or (
            policy is not None and (not isinstance(policy, Mapping) or "compute_dtype" in policy)
        )
        if named and cfg.precision.compute_dtype != wanted:
            _contradiction(cfg.precision.compute_dtype, loop.precision)
    elif source is None or isinstance(source, ZeroConfig):
        cfg, notes = source or ZeroConfig(), []
    else:
        raise TypeError(
            "zeroshard: config must be a ZeroConfig, a dict, or a DeepSpeed config (a dict "
            f"or a path to its JSON file), got {type(source).__name__}"
        )
    current = cfg.precision.compute_dtype
    if current == wanted:
        return cfg, notes
    # fp32 is the config's default: the flag decides. Any other dtype was chosen.
    if current != torch.float32:
        _contradiction(current, loop.precision)
    return cfg.replace(compute_dtype=wanted), notes


def _contradiction(dtype: torch.dtype, precision: str) -> None:
    raise ValueError(
        f"zeroshard: the config computes in {dtype} but precision={precision!r} computes in "
        f"{compute_dtype_of(precision)}; make them agree (the precision flag alone is enough)"
    )


def _from_deepspeed(
    source: Mapping[str, Any] | str | os.PathLike[str], loop: LoopSettings, wanted: torch.dtype
) -> tuple[ZeroConfig, list[str]]:
    config = dict(_read_json(source) if isinstance(source, (str, os.PathLike)) else source)
    notes = []
    unread = list(_BATCH_KEYS) + (list(_LOOP_KEYS) if loop.accumulate_grad_batches is None else [])
    for key in unread:
        if key in config:
            del config[key]
            notes.append(f"{key}: not read (the DataLoader and the training loop decide)")
    for block, on in (("bf16", wanted == torch.bfloat16), ("fp16", wanted == torch.float16)):
        value = config.get(block, {})
        if not isinstance(value, Mapping):
            continue  # read_deepspeed_config names the bad value
        enabled = value.get("enabled", _AUTO)
        if enabled != _AUTO and enabled is not on:
            raise ValueError(
                f"zeroshard: {block}.enabled={enabled!r} in the DeepSpeed config but "
                f"precision={loop.precision!r}; make them agree or set {block}.enabled to 'auto'"
            )
        config[block] = {**value, "enabled": _AUTO}
    auto = AutoValues(
        hidden_size=loop.hidden_size,
        bf16=wanted == torch.bfloat16,
        fp16=wanted == torch.float16,
        gradient_accumulation_steps=loop.accumulate_grad_batches,
        gradient_clipping=loop.gradient_clip_val,
    )
    settings = read_deepspeed_config(config, auto)
    return settings.zero, [*notes, *settings.not_honoured]


def _read_json(path: str | os.PathLike[str]) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(
            f"zeroshard: cannot read the DeepSpeed config {os.fspath(path)!r}: {err}"
        ) from None
