"""A DeepSpeed `ds_config.json` on the Hugging Face Trainer path: "auto" filled from the
`TrainingArguments` and the model, values that contradict them refused (duck-typed:
transformers is not imported)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from zeroshard.engine.config._deepspeed_config import (
    DeepSpeedSettings,
    _load_json,
    read_deepspeed_config,
    trainer_auto_values,
)
from zeroshard.engine.config._deepspeed_translate import AUTO
from zeroshard.engine.config._validate import shown


def trainer_ds_settings(
    ds_config: Mapping[str, Any] | str | os.PathLike[str], args: Any, model: Any
) -> DeepSpeedSettings:
    """Read `ds_config` as DeepSpeed's Hugging Face integration does under a Trainer with
    `args` and `model`: a batch, clipping or precision value that is not "auto" and differs
    from the Trainer's is a ValueError naming the key."""
    config = _load_json(ds_config) if isinstance(ds_config, (str, os.PathLike)) else ds_config
    if isinstance(config, Mapping):
        config = {**config, **{b: _precision_block(config, b) for b in ("bf16", "fp16")}}
    auto = trainer_auto_values(args, model)
    settings = read_deepspeed_config(config, auto)  # checks the batch and clipping keys
    # read_deepspeed_config fills "auto" precision but takes true/false as written; the
    # integration checks them against the Trainer's bf16 / fp16 too.
    for block, wanted in (("bf16", auto.bf16), ("fp16", auto.fp16)):
        value = config[block]["enabled"]
        if value != AUTO and value is not wanted:
            raise ValueError(
                f"{block}.enabled={shown(value)} in the DeepSpeed config but "
                f"TrainingArguments {block}={wanted}; make them equal or set {block}.enabled "
                "to 'auto'"
            )
    return settings


def _precision_block(config: Mapping[str, Any], block: str) -> Any:
    """The `bf16` / `fp16` block with a missing `enabled` read as "auto": the Trainer's
    `bf16` / `fp16` decide, as they do without a DeepSpeed config."""
    value = config.get(block, {})
    return {"enabled": AUTO, **value} if isinstance(value, Mapping) else value
