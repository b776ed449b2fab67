"""ZeroConfig validation and DeepSpeed dict translation (no process group needed)."""

from __future__ import annotations

import pytest
import torch

from zeroshard.engine import ZeroConfig
from zeroshard.engine._config import as_config


def test_defaults_and_dtype_strings() -> None:
    cfg = as_config({"stage": 1, "compute_dtype": "bf16", "reduce_dtype": torch.float32})
    assert cfg.stage == 1
    assert cfg.compute_dtype == torch.bfloat16
    assert cfg.grad_reduce_dtype == torch.float32
    assert as_config({"compute_dtype": "fp16"}).grad_reduce_dtype == torch.float16
    assert as_config(None) == ZeroConfig()


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"stage": 4}, "stage must be"),
        ({"stage": 0}, "stage must be"),
        ({"compute_dtype": "int8"}, "is not a dtype"),
        ({"compute_dtype": torch.float64}, "not supported"),
        ({"reduce_bucket_bytes": 0}, "positive integer"),
        ({"flatten_tier": "gpu"}, "flatten_tier"),
        ({"initial_loss_scale": 1.0, "min_loss_scale": 2.0}, "min_loss_scale"),
        ({"stgae": 2}, "unknown ZeroConfig keys \\['stgae'\\]; valid keys"),
    ],
)
def test_bad_config_is_a_clear_error(bad: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        as_config(bad)


def test_unknown_key_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError) as err:
        as_config({"stage": 2, "bucket": 3})
    assert "reduce_bucket_bytes" in str(err.value)


def test_deepspeed_zero_optimization_dict() -> None:
    cfg = as_config(
        {
            "stage": 2,
            "reduce_bucket_size": 5e7,
            "allgather_bucket_size": 2e8,
            "overlap_comm": False,
            "contiguous_gradients": True,
            "reduce_scatter": True,
        }
    )
    assert cfg.stage == 2
    assert cfg.overlap is False
    # DeepSpeed counts elements, we count bytes (fp32 compute here: 4 bytes each).
    assert cfg.reduce_bucket_bytes == 50_000_000 * 4
    assert cfg.allgather_bucket_bytes == 200_000_000 * 4


def test_deepspeed_full_config_with_precision() -> None:
    cfg = as_config(
        {
            "zero_optimization": {"stage": 1, "reduce_bucket_size": 1000},
            "bf16": {"enabled": True},
        }
    )
    assert (cfg.stage, cfg.compute_dtype, cfg.reduce_bucket_bytes) == (1, torch.bfloat16, 2000)
    fp16 = as_config(
        {"zero_optimization": {"stage": 2}, "fp16": {"enabled": True, "initial_scale_power": 8}}
    )
    assert fp16.compute_dtype == torch.float16
    assert fp16.initial_loss_scale == 256.0


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"stage": 2, "sub_group_size": 1000}, "unsupported DeepSpeed"),
        ({"stage": 2, "reduce_scatter": False}, "reduce_scatter=false"),
        ({"zero_optimization": {"stage": 2}, "train_batch_size": 8}, "train_batch_size"),
        (
            {"zero_optimization": {}, "bf16": {"enabled": True}, "fp16": {"enabled": True}},
            "both bf16 and fp16",
        ),
        ({"zero_optimization": {}, "fp16": {"enabled": True, "loss_scale": 128}}, "static"),
    ],
)
def test_bad_deepspeed_config(bad: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        as_config(bad)


def test_config_is_frozen_and_replace_revalidates() -> None:
    cfg = ZeroConfig()
    with pytest.raises(AttributeError):
        cfg.stage = 1  # type: ignore[misc]
    with pytest.raises(ValueError):
        cfg.replace(stage=7)
    assert cfg.replace(stage=1).stage == 1
