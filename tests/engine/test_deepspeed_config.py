"""DeepSpeed configs as people write them: zero_optimization dicts, "auto" values, whole
ds_config.json files (no process group needed)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from zeroshard.engine import (
    AutoValues,
    ZeroConfig,
    hidden_size_of,
    read_deepspeed_config,
    trainer_auto_values,
)
from zeroshard.engine.config._config import as_config

# The Hugging Face docs' ZeRO-3 config (ds_config_zero3.json), "auto" wherever they write it.
HF_ZERO3: dict[str, Any] = json.loads(
    (Path(__file__).resolve().parents[1] / "data" / "ds_config_zero3.json").read_text()
)
TRAINER = AutoValues(
    hidden_size=48,
    bf16=True,
    fp16=False,
    micro_batch_size_per_gpu=4,
    gradient_accumulation_steps=2,
    world_size=2,
    gradient_clipping=1.0,
)


def test_zero_optimization_dict() -> None:
    cfg = as_config(
        {
            "stage": 2,
            "reduce_bucket_size": 5e7,
            "allgather_bucket_size": 200_000_000,
            "overlap_comm": False,
            "contiguous_gradients": True,
            "reduce_scatter": True,
        }
    )
    # DeepSpeed counts elements, we count bytes (fp32 compute here: 4 bytes each).
    flat = {"stage": 2, "overlap": False}
    assert cfg == ZeroConfig.from_dict(
        {**flat, "reduce_bucket_bytes": 50_000_000 * 4, "allgather_bucket_bytes": 800_000_000}
    )


def test_deepspeed_config_with_precision() -> None:
    cfg = as_config(
        {"zero_optimization": {"stage": 1, "reduce_bucket_size": 1000}, "bf16": {"enabled": True}}
    )
    assert (cfg.stage, cfg.precision.compute_dtype, cfg.comm.reduce_bucket_bytes) == (
        1,
        torch.bfloat16,
        2000,
    )
    fp16 = as_config(
        {
            "zero_optimization": {"stage": 2},
            "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
            "communication_data_type": "fp32",
        }
    )
    assert (
        fp16.precision
        == ZeroConfig.from_dict({"compute_dtype": "fp16", "reduce_dtype": "fp32"}).precision
    )
    assert fp16.loss_scale.initial_scale == 256.0


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (
            {"stage": 2, "sub_group_size": 1000},
            "sub_group_size has no zeroshard equivalent.*read_deepspeed_config",
        ),
        (
            {"stage": 2, "ignore_unused_parameters": True},
            "ignore_unused_parameters is not supported",
        ),
        ({"stage": 2, "reduce_scatter": False}, "reduce_scatter=False .* always behaves as"),
        ({"stage": 2, "contiguous_gradients": 1}, r"contiguous_gradients=1 \(int\)"),
        ({"stage": 2, "reduce_bucket_sise": 10}, "did you mean 'reduce_bucket_size'"),
        (
            {"stage": 2, "reduce_bucket_size": "5e8"},
            "reduce_bucket_size must be a positive integer",
        ),
        ({"stage": 2, "reduce_bucket_size": 1.5}, "reduce_bucket_size must be a positive integer"),
        ({"stage": 2, "reduce_bucket_size": True}, "reduce_bucket_size must be a positive integer"),
        ({"stage": 2, "overlap_comm": "yes"}, "overlap_comm must be true or false"),
        ({"zero_optimization": {"stage": 0}}, "stage 0 is plain data parallelism"),
        ({"zero_optimization": {"stage": 2.0}}, "stage must be a positive int"),
        (
            {"zero_optimization": {"stage": 2}, "train_batch_size": 8},
            "train_batch_size.*read_deepspeed_config",
        ),
        ({"zero_optimization": []}, "zero_optimization must be a dict"),
        (
            {"zero_optimization": {}, "bf16": {"enabled": 1}},
            r"bf16.enabled must be true or false, got 1",
        ),
        ({"zero_optimization": {}, "bf16": {"enabled": True, "x": 1}}, "'bf16.x'"),
        (
            {"zero_optimization": {}, "bf16": {"enabled": True}, "fp16": {"enabled": True}},
            "both bf16 and fp16",
        ),
        ({"zero_optimization": {}, "fp16": {"enabled": True, "loss_scale": 128}}, "static"),
        ({"zero_optimization": {}, "fp16": {"enabled": True, "hysteresis": 2}}, "fp16.hysteresis"),
        (
            {"zero_optimization": {}, "fp16": {"enabled": True, "initial_scale_power": 2.5}},
            "initial_scale_power",
        ),
        (
            {"offload_optimizer": {"device": "cpu", "pin_memory": "no"}},
            "offload_optimizer.pin_memory",
        ),
    ],
)
def test_bad_deepspeed_config(bad: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        as_config(bad)


@pytest.mark.parametrize(
    "key",
    ["reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"],
)
def test_auto_without_the_hidden_size_names_the_key(key: str) -> None:
    with pytest.raises(ValueError, match=f"zero_optimization.{key} is 'auto'.*hidden_size"):
        as_config({"zero_optimization": {"stage": 3, key: "auto"}})


def test_auto_where_deepspeed_allows_none_is_refused() -> None:
    with pytest.raises(ValueError, match="stage3_max_live_parameters is 'auto'"):
        read_deepspeed_config(
            {"zero_optimization": {"stage3_max_live_parameters": "auto"}}, AutoValues(hidden_size=8)
        )


def test_bf16_auto_is_never_read_as_true() -> None:
    ds = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}}
    with pytest.raises(ValueError, match=r"bf16\.enabled is 'auto'"):
        as_config(ds)
    on = read_deepspeed_config(ds, AutoValues(bf16=True)).zero.precision.compute_dtype
    off = read_deepspeed_config(ds, AutoValues(bf16=False)).zero.precision.compute_dtype
    assert (on, off) == (torch.bfloat16, torch.float32)


# TrainingArguments as the Hugging Face integration reads them (the fields it touches).
ARGS = SimpleNamespace(
    world_size=2,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    max_grad_norm=1.0,
    learning_rate=1e-3,
    adam_beta1=0.9,
    adam_beta2=0.999,
    adam_epsilon=1e-8,
    weight_decay=0.0,
    save_on_each_node=False,
    fp16=False,
    fp16_full_eval=False,
    bf16=True,
    bf16_full_eval=False,
    get_warmup_steps=lambda steps: 0,
)
MODEL = SimpleNamespace(config=SimpleNamespace(hidden_size=48))


def _hf_resolved(ds: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The same config as transformers' own DeepSpeed integration fills it in from ARGS."""
    integration = pytest.importorskip("transformers.integrations.deepspeed")
    # Its constructor only checks that DeepSpeed is installed (CI has no DeepSpeed); the
    # "auto" filling compared here is transformers' own code and needs no DeepSpeed.
    monkeypatch.setattr(integration, "dep_version_check", lambda name: None)
    try:
        hf = integration.HfTrainerDeepSpeedConfig(copy.deepcopy(ds))
        hf.trainer_config_process(ARGS)
        hf.trainer_config_finalize(ARGS, MODEL, 100)
        resolved: dict[str, Any] = hf.config
    finally:
        # The constructor registered itself globally (is_deepspeed_zero3_enabled reads it).
        integration.unset_hf_deepspeed_config()
    return resolved


def test_trainer_auto_values() -> None:
    assert trainer_auto_values(ARGS, MODEL) == TRAINER


def test_whole_hf_config_resolves_as_transformers_does(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = read_deepspeed_config(HF_ZERO3, trainer_auto_values(ARGS, MODEL))
    hf = _hf_resolved(HF_ZERO3, monkeypatch)
    z, cfg = hf["zero_optimization"], settings.zero
    itemsize = 2  # bf16 from the Trainer's arguments
    assert cfg.precision.compute_dtype == torch.bfloat16 and hf["bf16"]["enabled"] is True
    assert cfg.comm.reduce_bucket_bytes == z["reduce_bucket_size"] * itemsize
    assert cfg.stage3.prefetch_bytes == z["stage3_prefetch_bucket_size"] * itemsize
    assert cfg.stage3.persistence_threshold == z["stage3_param_persistence_threshold"]
    assert cfg.stage3.max_live_bytes == int(z["stage3_max_live_parameters"]) * itemsize
    assert (cfg.stage, cfg.offload.optimizer, cfg.offload.params) == (3, True, True)
    assert settings.train_micro_batch_size_per_gpu == hf["train_micro_batch_size_per_gpu"]
    assert settings.gradient_accumulation_steps == hf["gradient_accumulation_steps"]
    assert settings.train_batch_size == hf["train_batch_size"] == 16
    assert settings.gradient_clipping == hf["gradient_clipping"]
    named = [line.split(":")[0] for line in settings.not_honoured]
    assert named == [
        "optimizer",
        "scheduler",
        "steps_per_print",
        "wall_clock_breakdown",
        "zero_optimization.sub_group_size",
        "zero_optimization.stage3_max_reuse_distance",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    ]
    assert "torch optimizer passed to initialize() is used" in settings.not_honoured[0]


def test_whole_config_values_are_checked() -> None:
    base = {"zero_optimization": {"stage": 2}}
    plain = read_deepspeed_config(base)
    assert plain.zero == ZeroConfig(stage=2) and plain.train_batch_size is None
    cases: list[tuple[dict[str, Any], AutoValues, str]] = [
        ({"train_batch_size": "auto"}, AutoValues(), "train_batch_size is 'auto' and nothing"),
        ({"gradient_clipping": "auto"}, AutoValues(), "gradient_clipping is 'auto'"),
        (
            {"train_micro_batch_size_per_gpu": 8},
            TRAINER,
            r"train_micro_batch_size_per_gpu=8 \(int\) in the DeepSpeed config but 4",
        ),
        (
            {
                "train_batch_size": 12,
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 2,
            },
            AutoValues(),
            "not a multiple",
        ),
        ({"train_batch_size": 0}, AutoValues(), "train_batch_size must be a positive integer"),
        ({"gradient_clipping": -1.0}, AutoValues(), "gradient_clipping must be a finite number"),
        ({"gradient_clipping": True}, AutoValues(), "gradient_clipping must be a finite number"),
        ({"train_batch_sise": 8}, AutoValues(), "did you mean 'train_batch_size'"),
        ({"amp": {"enabled": True}}, AutoValues(), "unknown DeepSpeed config keys 'amp'"),
    ]
    cases += [
        (
            {"train_micro_batch_size_per_gpu": "8", "gradient_accumulation_steps": 1},
            AutoValues(world_size=2),
            r"train_micro_batch_size_per_gpu must be a positive integer .* got '8' \(str\)",
        ),
        ({"fp16": {"enabled": False, "loss_scael": 0}}, AutoValues(), "'fp16.loss_scael'"),
    ]
    for extra, auto, message in cases:
        with pytest.raises(ValueError, match=message):
            read_deepspeed_config({**base, **extra}, auto)


def test_auto_values_are_checked() -> None:
    with pytest.raises(ValueError, match=r"AutoValues.bf16 must be true or false, got 1"):
        AutoValues(bf16=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"AutoValues\.hidden_size must be a positive int"):
        AutoValues(hidden_size=0)
    with pytest.raises(ValueError, match=r"AutoValues\.gradient_clipping must be"):
        AutoValues(gradient_clipping=float("nan"))


def test_json_file_and_its_faults(tmp_path: Path) -> None:
    good = tmp_path / "ds_config.json"
    good.write_text(json.dumps(HF_ZERO3))
    assert read_deepspeed_config(good, TRAINER) == read_deepspeed_config(HF_ZERO3, TRAINER)
    assert read_deepspeed_config(str(good), TRAINER).zero.stage == 3
    faults = {
        "broken.json": ('{"zero_optimization": {"stage": 2,}}', "not valid JSON: .* line 1"),
        "deep.json": ("[" * 100_000 + "]" * 100_000, "nests too deeply"),
        "nan.json": ('{"gradient_clipping": NaN}', "JSON constant NaN"),
        "list.json": ("[1, 2]", r"must be a dict, got \[1, 2\] \(list\)"),
    }
    for name, (text, message) in faults.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=message):
            read_deepspeed_config(tmp_path / name)
    (tmp_path / "latin1.json").write_bytes(b'{"steps_per_print": "\xe9"}')
    for name in ("missing.json", "latin1.json"):
        with pytest.raises(ValueError, match="cannot read the DeepSpeed config"):
            read_deepspeed_config(tmp_path / name)


def test_hidden_size_of_follows_the_hf_rules() -> None:
    def model(**config: Any) -> SimpleNamespace:
        return SimpleNamespace(config=SimpleNamespace(**config))

    assert hidden_size_of(model(hidden_size=64)) == 64
    assert hidden_size_of(model(hidden_sizes=[32, 96, 64])) == 96
    assert hidden_size_of(model(text_config=SimpleNamespace(hidden_size=80))) == 80
    assert hidden_size_of(model()) is None
    assert hidden_size_of(torch.nn.Linear(2, 2)) is None
