"""A whole DeepSpeed `ds_config.json` as people write it: the ZeroConfig, the training-level
values for the caller to check, and what zeroshard does not honour."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.config._deepspeed_translate import (
    AUTO,
    PRECISION_BLOCKS,
    AutoValues,
    deepspeed_int,
    translate_deepspeed,
)
from zeroshard.engine.config._validate import shown, unknown_keys_error

_TRAINING_KEYS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
)
# Top-level keys zeroshard reads no setting from, with what it does instead.
_NOT_READ = {
    "optimizer": "zeroshard builds no optimizer: the torch optimizer passed to initialize() "
    "is used",
    "scheduler": "zeroshard builds no scheduler: step your torch LR scheduler yourself",
    "zero_allow_untested_optimizer": "any torch optimizer is allowed",
    "zero_force_ds_cpu_optimizer": "the torch optimizer steps the offloaded state",
    "activation_checkpointing": "use torch.utils.checkpoint in the model",
    "steps_per_print": "zeroshard prints nothing per step",
    "wall_clock_breakdown": "use the torch profiler (zeroshard:: labels)",
    "gradient_predivide_factor": "gradients are averaged over ranks once",
    "prescale_gradients": "gradients are averaged over ranks once",
    "memory_breakdown": "not offered",
    "dump_state": "not offered",
    "tensorboard": "logging is the caller's",
    "wandb": "logging is the caller's",
    "csv_monitor": "logging is the caller's",
    "comms_logger": "logging is the caller's",
    "flops_profiler": "use the torch profiler",
    "checkpoint": "checkpoints are written by save_checkpoint",
}


@dataclass(frozen=True)
class DeepSpeedSettings:
    """What a DeepSpeed config says, as zeroshard reads it; None where the config is silent.
    The training-level values are the caller's to apply or to check against its own."""

    zero: ZeroConfig
    """The engine configuration (from `zero_optimization`, `bf16`, `fp16`,
    `communication_data_type`)."""

    train_batch_size: int | None
    """Samples per optimizer step over all ranks (= world * micro batch * accumulation)."""

    train_micro_batch_size_per_gpu: int | None
    """Samples per rank per forward/backward."""

    gradient_accumulation_steps: int | None
    """Micro-batches per optimizer step."""

    gradient_clipping: float | None
    """Max global gradient norm (0: no clipping); `optimizer.clip_grad_norm_` applies it."""

    not_honoured: tuple[str, ...]
    """One line per key zeroshard reads no setting from, saying what it does instead."""


def read_deepspeed_config(
    source: Mapping[str, Any] | str | os.PathLike[str], auto: AutoValues | None = None
) -> DeepSpeedSettings:
    """Read a DeepSpeed config (a dict or a JSON file), filling "auto" values from `auto`.

    An "auto" that `auto` cannot fill, a value that contradicts `auto`, an unknown key or a
    bad value is a ValueError naming the key.
    """
    config = _load_json(source) if isinstance(source, (str, os.PathLike)) else source
    if not isinstance(config, Mapping):
        raise ValueError(f"a DeepSpeed config must be a dict, got {shown(config)}")
    for key in config:
        if not isinstance(key, str):
            raise ValueError(f"DeepSpeed config keys must be strings, got {shown(key)}")
    known = (*PRECISION_BLOCKS, *_TRAINING_KEYS, *_NOT_READ)
    unknown = sorted(set(config) - set(known))
    if unknown:
        raise unknown_keys_error("DeepSpeed config keys", unknown, known)
    auto = auto or AutoValues()
    notes = [f"{key}: not honoured ({why})" for key, why in _NOT_READ.items() if key in config]
    precision = {k: v for k, v in config.items() if k in PRECISION_BLOCKS}
    flat = translate_deepspeed({"zero_optimization": {}, **precision}, auto, notes)
    micro, accumulation, total, clipping = _training_values(config, auto)
    return DeepSpeedSettings(
        zero=ZeroConfig.from_dict(flat),
        train_batch_size=total,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=accumulation,
        gradient_clipping=clipping,
        not_honoured=tuple(notes),
    )


def _load_json(path: str | os.PathLike[str]) -> Any:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read the DeepSpeed config {os.fspath(path)!r}: {err}") from err
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{os.fspath(path)!r} is not valid JSON: {err.msg} at line {err.lineno}, "
            f"column {err.colno}"
        ) from None
    except RecursionError:
        raise ValueError(f"{os.fspath(path)!r} nests too deeply to be a DeepSpeed config") from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"JSON constant {name} is not a config value (use a finite number)")


def _training_values(
    config: Mapping[str, Any], auto: AutoValues
) -> tuple[int | None, int | None, int | None, float | None]:
    """(micro batch, accumulation, total batch, clipping) with "auto" filled and each value
    checked against `auto` where both are given, as the Hugging Face integration does."""
    micro = _batch_value(config, "train_micro_batch_size_per_gpu", auto.micro_batch_size_per_gpu)
    accumulation = _batch_value(
        config, "gradient_accumulation_steps", auto.gradient_accumulation_steps
    )
    known_total = None
    if auto.world_size is not None and micro is not None and accumulation is not None:
        known_total = auto.world_size * micro * accumulation
    total = _batch_value(config, "train_batch_size", known_total)
    if (
        total is not None
        and micro is not None
        and accumulation is not None
        and total % (micro * accumulation) != 0
    ):
        raise ValueError(
            f"train_batch_size {total} is not a multiple of train_micro_batch_size_per_gpu "
            f"{micro} x gradient_accumulation_steps {accumulation}"
        )
    clipping = _fill(config, "gradient_clipping", auto.gradient_clipping)
    if clipping is not None:
        finite = isinstance(clipping, (int, float)) and math.isfinite(clipping)
        if isinstance(clipping, bool) or not finite or clipping < 0:
            raise ValueError(
                f"gradient_clipping must be a finite number >= 0, got {shown(clipping)}"
            )
        clipping = float(clipping)
    return micro, accumulation, total, clipping


def _batch_value(config: Mapping[str, Any], key: str, known: int | None) -> int | None:
    value = _fill(config, key, known)
    return None if value is None else deepspeed_int(key, value, minimum=1)


def _fill(config: Mapping[str, Any], key: str, known: Any) -> Any:
    """The config's value for `key`, "auto" replaced by `known`; a value differing from a
    known one is an error (the Hugging Face integration's "mismatch")."""
    value = config.get(key)
    if value == AUTO:
        if known is None:
            raise ValueError(
                f"{key} is 'auto' and nothing fills it: pass it in AutoValues "
                f"(the Trainer fills it from its arguments) or write a value"
            )
        return known
    if value is not None and known is not None and value != known:
        raise ValueError(
            f"{key}={shown(value)} in the DeepSpeed config but {known!r} from the training "
            f"arguments; make them equal or set {key} to 'auto'"
        )
    return value


def hidden_size_of(model: Any) -> int | None:
    """The hidden size DeepSpeed's Hugging Face integration reads from `model.config`
    (`hidden_size`, the largest of `hidden_sizes`, or the same under `text_config`)."""
    config = getattr(model, "config", None)
    for holder in (config, getattr(config, "text_config", None)):
        if holder is None:
            continue
        if hasattr(holder, "hidden_size"):
            return int(holder.hidden_size)
        if hasattr(holder, "hidden_sizes"):
            return int(max(holder.hidden_sizes))
    return None


def trainer_auto_values(args: Any, model: Any) -> AutoValues:
    """AutoValues from a `transformers.TrainingArguments` and the model, read as DeepSpeed's
    Hugging Face integration reads them (duck-typed: transformers is not imported)."""
    return AutoValues(
        hidden_size=hidden_size_of(model),
        bf16=bool(args.bf16 or args.bf16_full_eval),
        fp16=bool(args.fp16 or args.fp16_full_eval),
        micro_batch_size_per_gpu=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        world_size=args.world_size,
        gradient_clipping=args.max_grad_norm,
    )
