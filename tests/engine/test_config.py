"""ZeroConfig as policies: flat and nested dicts, exact validation (no process group needed)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import zeroshard.engine as zs
from zeroshard.engine import (
    CommPolicy,
    LossScalePolicy,
    OffloadPolicy,
    PrecisionPolicy,
    Stage3Policy,
    ZeroConfig,
)
from zeroshard.engine.config._config import FLAT_KEYS, as_config


def test_defaults_and_dtype_strings() -> None:
    cfg = as_config({"stage": 1, "compute_dtype": "bf16", "reduce_dtype": torch.float32})
    assert cfg.stage == 1
    assert cfg.precision.compute_dtype == torch.bfloat16
    assert cfg.precision.grad_reduce_dtype == torch.float32
    assert as_config({"compute_dtype": "fp16"}).precision.grad_reduce_dtype == torch.float16
    assert as_config(None) == ZeroConfig()


def test_every_flat_key_lands_in_its_policy() -> None:
    # One non-default value per flat key, all at once (stage 3 so offload_params is allowed).
    flat: dict[str, Any] = {
        "stage": 3,
        "shard_group_size": 2,
        "flatten_tier": "cpu",
        "compute_dtype": "fp16",
        "reduce_dtype": "fp32",
        # The default: bf16 masters need bf16 compute and no offload (test_bf16_masters.py).
        "master_dtype": "fp32",
        "initial_loss_scale": 1024.0,
        "loss_scale_window": 50,
        "min_loss_scale": 2.0,
        "reduce_bucket_bytes": 1000,
        "allgather_bucket_bytes": 2000,
        "overlap": False,
        "max_inflight_reductions": 3,
        "collective_timeout_s": 30.0,
        "unit_modules": ["Block"],
        "leaf_modules": ["MoE"],
        "min_unit_params": 7,
        "leaf_params_per_module": 5,
        "prefetch_depth": 2,
        "prefetch_bytes": 4096,
        "max_live_bytes": 8192,
        "persistence_threshold": 11,
        "offload_optimizer": True,
        "offload_ratio": 0.25,
        "offload_params": True,
        "offload_pin_memory": False,
        "offload_chunk_bytes": 512,
        # True needs stage 1 or 2: it lands in its policy below, at stage 2.
        "offload_delay_param_update": False,
        "offload_compiled_step": True,
    }
    assert sorted(flat) == sorted(FLAT_KEYS)  # the test covers every key
    cfg = ZeroConfig.from_dict(flat)
    assert cfg == ZeroConfig(
        stage=3,
        shard_group_size=2,
        flatten_tier="cpu",
        precision=PrecisionPolicy(torch.float16, torch.float32),
        loss_scale=LossScalePolicy(initial_scale=1024.0, window=50, min_scale=2.0),
        comm=CommPolicy(
            1000, 2000, overlap=False, max_inflight_reductions=3, collective_timeout_s=30.0
        ),
        stage3=Stage3Policy(("Block",), ("MoE",), 7, 5, 2, 4096, 8192, 11),
        offload=OffloadPolicy(True, 0.25, True, False, 512, compiled_step=True),
    )
    # Round trip: to_dict gives the same flat keys back, JSON-ready.
    assert cfg.to_dict() == {**flat, "compute_dtype": "fp16", "reduce_dtype": "fp32"}
    assert ZeroConfig.from_dict(cfg.to_dict()) == cfg
    assert ZeroConfig.from_dict(ZeroConfig().to_dict()) == ZeroConfig()
    delayed = cfg.replace(stage=2, offload_params=False, offload_delay_param_update=True)
    assert delayed.offload == OffloadPolicy(True, 0.25, False, False, 512, True, True)


def test_policies_as_nested_dicts_and_replace() -> None:
    cfg = ZeroConfig.from_dict(
        {"stage": 3, "precision": {"compute_dtype": "bf16"}, "stage3": {"prefetch_depth": 4}}
    )
    assert cfg.precision.compute_dtype == torch.bfloat16 and cfg.stage3.prefetch_depth == 4
    # replace takes flat keys and policies; the rest is kept.
    changed = cfg.replace(stage=2, reduce_bucket_bytes=4096)
    assert (changed.stage, changed.comm.reduce_bucket_bytes) == (2, 4096)
    assert changed.precision == cfg.precision and changed.stage3 == cfg.stage3
    assert cfg.replace(precision=PrecisionPolicy()).precision.compute_dtype == torch.float32
    with pytest.raises(ValueError, match="compute_dtype is set twice"):
        ZeroConfig.from_dict({"compute_dtype": "bf16", "precision": {"compute_dtype": "fp16"}})
    with pytest.raises(
        ValueError, match=r"'precision.compute_dtpye' \(did you mean 'compute_dtype'"
    ):
        ZeroConfig.from_dict({"precision": {"compute_dtpye": "bf16"}})
    with pytest.raises(ValueError, match="precision must be a PrecisionPolicy"):
        ZeroConfig.from_dict({"precision": "bf16"})


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"stage": 4}, "stage must be 1, 2 or 3"),
        ({"stage": 0}, "stage must be 1, 2 or 3"),
        ({"stage": True}, r"stage must be 1, 2 or 3 \(an int\), got True \(bool\)"),
        ({"stage": 2.0}, r"stage must be a positive int, got 2.0 \(float\)"),
        ({"stage": "3"}, r"stage must be 1, 2 or 3 \(an int\), got '3' \(str\)"),
        ({"compute_dtype": "int8"}, "is not a dtype"),
        ({"compute_dtype": torch.float64}, "not supported"),
        ({"reduce_dtype": 16}, "precision.reduce_dtype.*not a dtype"),
        ({"reduce_bucket_bytes": 0}, "comm.reduce_bucket_bytes must be a positive int"),
        ({"reduce_bucket_bytes": 5e8}, r"positive int, got 500000000.0 \(float\)"),
        ({"allgather_bucket_bytes": -1}, "comm.allgather_bucket_bytes must be a positive int"),
        ({"max_inflight_reductions": True}, "max_inflight_reductions must be a positive int"),
        ({"prefetch_bytes": 1.5}, "stage3.prefetch_bytes must be a positive int"),
        ({"max_live_bytes": 0}, "stage3.max_live_bytes must be a positive int"),
        ({"offload_chunk_bytes": 0}, r"offload.chunk_bytes \(offload_chunk_bytes\) must be"),
        ({"prefetch_depth": -1}, "stage3.prefetch_depth must be an int >= 0"),
        ({"persistence_threshold": False}, "stage3.persistence_threshold must be an int >= 0"),
        ({"min_unit_params": 1.0}, "stage3.min_unit_params must be an int >= 0"),
        ({"leaf_params_per_module": None}, "stage3.leaf_params_per_module must be"),
        ({"shard_group_size": 0}, "shard_group_size must be a positive int"),
        ({"shard_group_size": True}, "shard_group_size must be a positive int"),
        ({"overlap": 1}, r"comm.overlap must be true or false, got 1 \(int\)"),
        ({"offload_pin_memory": "yes"}, "offload.pin_memory .* must be true or false"),
        ({"flatten_tier": "gpu"}, r"flatten_tier must be one of \['auto', 'device'"),
        ({"unit_modules": "Block"}, "stage3.unit_modules must be a list of module"),
        ({"leaf_modules": [1]}, "stage3.leaf_modules must be a list of module"),
        ({"initial_loss_scale": math.inf}, "initial_scale .* must be a finite number > 0"),
        ({"initial_loss_scale": math.nan}, "initial_scale .* must be a finite number > 0"),
        ({"initial_loss_scale": 0.0}, "initial_scale .* must be a finite number > 0"),
        ({"min_loss_scale": -1.0}, "min_scale .* must be a finite number > 0"),
        ({"initial_loss_scale": 1.0, "min_loss_scale": 2.0}, "min_loss_scale"),
        ({"loss_scale_window": 0}, r"loss_scale.window \(loss_scale_window\) must be"),
        ({"collective_timeout_s": math.inf}, "comm.collective_timeout_s must be a finite"),
        ({"collective_timeout_s": 0}, "comm.collective_timeout_s must be a finite"),
        ({"offload_optimizer": True, "offload_ratio": math.nan}, r"offload.ratio"),
        ({"offload_optimizer": True, "offload_ratio": 1.5}, r"must be in \(0, 1\]"),
        ({"stgae": 2}, r"unknown ZeroConfig keys 'stgae' \(did you mean 'stage'\?\); valid keys"),
        ({1: 2}, r"config keys must be strings, got 1 \(int\)"),
    ],
)
def test_bad_config_is_a_clear_error(bad: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        as_config(bad)


def test_policies_check_themselves() -> None:
    with pytest.raises(ValueError, match=r"stage3\.prefetch_depth"):
        Stage3Policy(prefetch_depth=-2)
    with pytest.raises(ValueError, match=r"offload\.params .* needs offload\.optimizer"):
        OffloadPolicy(params=True)
    with pytest.raises(ValueError, match="needs stage 3"):
        ZeroConfig(stage=2, offload=OffloadPolicy(optimizer=True, params=True))
    with pytest.raises(ValueError, match="comm must be a CommPolicy"):
        ZeroConfig(comm={"overlap": False})  # type: ignore[arg-type]


def test_deep_or_odd_values_give_a_short_message() -> None:
    deep: dict[str, Any] = {}
    node = deep
    for _ in range(50_000):
        node["a"] = {}
        node = node["a"]
    with pytest.raises(ValueError, match=r"comm.overlap must be true or false, got \{'a'"):
        as_config({"overlap": deep})
    with pytest.raises(ValueError) as err:
        as_config({"stage": list(range(10_000))})
    assert len(str(err.value)) < 200


def test_unknown_key_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError) as err:
        as_config({"stage": 2, "bucket": 3})
    assert "reduce_bucket_bytes" in str(err.value)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        # DeepSpeed's key where ours was meant: the error says why the dict was read as
        # DeepSpeed's and names our key.
        (
            {"stage": 3, "offload_param": True},
            r"offload_param must be a dict .*read as DeepSpeed's config because of "
            r"\['offload_param'\]; 'offload_param' is DeepSpeed's key: did you mean "
            r"zeroshard's 'offload_params'\?",
        ),
        # Our keys beside DeepSpeed's: refused, naming both.
        (
            {"stage": 3, "compute_dtype": "bf16", "offload_param": {"device": "cpu"}},
            r"config mixes zeroshard keys \['compute_dtype'\] with DeepSpeed keys "
            r"\['offload_param'\]: a dict is read as one or the other; .*did you mean "
            r"zeroshard's 'offload_params'\?",
        ),
        (
            {"offload_optimizer": {"device": "cpu"}, "offload_chunk_bytes": 1 << 20},
            r"mixes zeroshard keys \['offload_chunk_bytes'\] with DeepSpeed keys "
            r"\['offload_optimizer \(a dict\)'\]",
        ),
        (
            {"zero_optimization": {"stage": 2}, "compute_dtype": "bf16"},
            r"mixes zeroshard keys \['compute_dtype'\] with DeepSpeed keys "
            r"\['zero_optimization'\]",
        ),
    ],
)
def test_deepspeed_spelling_where_ours_was_meant(bad: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        as_config(bad)
    # Each spelling alone is read.
    assert as_config({"stage": 3, "offload_optimizer": True, "offload_params": True}).offload.params
    ds = {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    assert as_config(ds).offload.params


def test_not_a_dict_is_refused() -> None:
    with pytest.raises(TypeError, match="config must be a ZeroConfig or a dict, got str"):
        as_config("ds_config.json")  # type: ignore[arg-type]


def test_config_is_frozen_and_replace_revalidates() -> None:
    cfg = ZeroConfig()
    with pytest.raises(AttributeError):
        cfg.stage = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        cfg.precision.compute_dtype = torch.float16  # type: ignore[misc]
    with pytest.raises(ValueError):
        cfg.replace(stage=7)
    with pytest.raises(ValueError, match="unknown ZeroConfig keys"):
        cfg.replace(stages=1)
    assert cfg.replace(stage=1).stage == 1


def test_public_names() -> None:
    for name in ("ZeroConfig", "PrecisionPolicy", "read_deepspeed_config", "AutoValues"):
        assert name in zs.__all__
