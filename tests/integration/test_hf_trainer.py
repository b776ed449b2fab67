"""`transformers.Trainer` on zeroshard (examples/hf_trainer.py) against the Trainer's own DDP.

One spawn of 2 gloo ranks runs the example's `main` (a Llama of hidden 128, so that each
layer is a stage-3 unit) for the DDP baseline (stage 0), stages 1-3 and a stage-3 resume
from checkpoint-4, all fp32 with gradient accumulation 2, and compares what the Trainer
logged (and a bf16 run at stage 2 against the fp32 curve, a run from an all-"auto"
DeepSpeed ZeRO-3 config, and a stage-3 run with `torch_compile`, each layer compiled with
aot_eager: one graph for both); a second spawn of 1 rank resumes the 2-rank checkpoint
(another world size, the same global batch). `load_best_model_at_end` must bring back the
best checkpoint's weights, not keep the last ones; ranks that see different checkpoint
files raise alike. Arguments that count fewer processes than the process group are
refused; a resume into its own output folder writes its checkpoints again.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from tests._dist import run_ranks

pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS, SAVE = 8, 4
HIDDEN, LAYERS = 128, 2
LOSS_ATOL = 2e-4  # the Trainer logs the loss rounded to 4 decimals
NORM_RTOL = 1e-4  # fp32, reduction order differs between DDP and reduce-scatter
WEIGHT_ATOL = 2e-5  # 8 AdamW steps at lr 3e-3 in fp32
# The Hugging Face docs' ZeRO-3 config (ds_config_zero3.json), "auto" wherever they write it.
HF_DOCS_ZERO3: dict[str, Any] = json.loads(
    (Path(__file__).resolve().parents[1] / "data" / "ds_config_zero3.json").read_text()
)


def _run(out: Path, stage: int, *extra: str) -> Any:
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import hf_trainer  # type: ignore[import-not-found]

    argv = ["--stage", str(stage), "--max-steps", str(STEPS), "--save-steps", str(SAVE), "--cpu"]
    # Hidden 128: each layer (about 150k parameters) is over the default `min_unit_params`,
    # so stage 3 gathers and releases layer by layer (at 64 the root was the only unit).
    argv += ["--hidden", str(HIDDEN), "--layers", str(LAYERS)]
    return hf_trainer.main([*argv, "--output-dir", str(out), *extra])


def _per_step(log_history: list[dict[str, Any]]) -> dict[int, tuple[float, float]]:
    return {e["step"]: (e["loss"], e["grad_norm"]) for e in log_history if "loss" in e}


def _assert_same_steps(
    got: dict[int, tuple[float, float]], want: dict[int, tuple[float, float]], what: str
) -> None:
    assert sorted(got) == sorted(want), f"{what}: logged steps {sorted(got)} != {sorted(want)}"
    for step, (loss, norm) in want.items():
        g_loss, g_norm = got[step]
        assert abs(g_loss - loss) <= LOSS_ATOL, f"{what} step {step}: loss {g_loss} != {loss}"
        assert math.isclose(g_norm, norm, rel_tol=NORM_RTOL), (
            f"{what} step {step}: grad_norm {g_norm} != {norm}"
        )


def _assert_same_weights(a: Path, b: Path, what: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model_a, info = AutoModelForCausalLM.from_pretrained(a, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], f"{what}: {info}"
    model_b = AutoModelForCausalLM.from_pretrained(b)
    sa, sb = model_a.state_dict(), model_b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], atol=WEIGHT_ATOL, rtol=0, msg=f"{what}: {k}")


def _train_all_stages(root: str) -> None:
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    import zeroshard.engine as zs

    out = Path(root)
    accum = ["--per-device-batch", "1", "--grad-accum", "2"]
    base = _per_step(_run(out / "stage0", 0, *accum).state.log_history)
    assert sorted(base) == list(range(1, STEPS + 1))
    assert all(norm > 0 for _, norm in base.values())
    for stage in (1, 2, 3):
        trainer = _run(out / f"stage{stage}", stage, *accum)
        # The engine reduces the gradients: nothing may wrap the model in DDP on top.
        assert trainer.model_wrapped is trainer.model, type(trainer.model_wrapped)
        _assert_same_steps(_per_step(trainer.state.log_history), base, f"stage {stage}")
        if stage == 3:  # the root and one unit per layer
            runtime = zs.engine_state(trainer.model).stage3
            assert runtime is not None and len(runtime.units) == 1 + LAYERS, runtime
    ds = _run(out / "ds", 3, *accum, "--ds-config", str(out / "ds_config.json"))
    cfg = zs.engine_state(ds.model).config
    # "auto" filled from the model's hidden size as the Hugging Face integration does.
    assert (cfg.stage, cfg.stage3.persistence_threshold) == (3, 10 * HIDDEN), cfg
    assert cfg.offload.optimizer and cfg.offload.params, cfg.offload
    _assert_same_steps(_per_step(ds.state.log_history), base, "all-auto ZeRO-3 ds_config")
    counters.clear()
    compiled = _run(out / "compiled", 3, *accum, "--torch-compile", "aot_eager")
    # Each decoder layer's forward compiled, one graph for both, no eager fallback.
    layers = compiled.model.model.layers
    assert all(hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in layers)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert counters["stats"]["calls_captured"] > 0, dict(counters["stats"])
    _assert_same_steps(_per_step(compiled.state.log_history), base, "stage 3, torch_compile")
    resumed = _run(
        out / "resumed",
        3,
        *accum,
        "--resume-from-checkpoint",
        str(out / "stage3" / f"checkpoint-{SAVE}"),
    )
    want = {s: v for s, v in base.items() if s > SAVE}
    got = {s: v for s, v in _per_step(resumed.state.log_history).items() if s > SAVE}
    _assert_same_steps(got, want, "stage 3 resumed from checkpoint-4")
    bf16 = _run(out / "bf16", 2, *accum, "--bf16")
    assert zs.engine_state(bf16.model).config.precision.compute_dtype == torch.bfloat16
    for step, (loss, _) in _per_step(bf16.state.log_history).items():
        # bf16 compute (8-bit mantissa) against fp32: the same curve within 2%.
        assert abs(loss - base[step][0]) <= 0.02 * base[step][0], (step, loss, base[step])
    with pytest.raises(FileNotFoundError, match="holds no zeroshard state"):
        _run(out / "bad", 3, "--resume-from-checkpoint", str(out / "stage0" / f"checkpoint-{SAVE}"))
    dist.barrier()
    if dist.get_rank() == 0:
        for stage in (1, 2, 3):
            _assert_same_weights(out / f"stage{stage}", out / "stage0", f"stage {stage} save_model")
        _assert_same_weights(out / "resumed", out / "stage0", "resumed save_model")
        _assert_same_weights(out / "ds", out / "stage0", "ds_config save_model")
        _assert_same_weights(out / "compiled", out / "stage0", "torch_compile save_model")
        ckpt = out / "stage3" / f"checkpoint-{SAVE}"
        assert (ckpt / "zeroshard" / "metadata.json").is_file()
        logged = json.loads((ckpt / "trainer_state.json").read_text())["log_history"]
        assert [e["step"] for e in logged if "loss" in e and "grad_norm" in e] == [1, 2, 3, 4]


def _resume_on_one_rank(root: str) -> None:
    out = Path(root)
    resumed = _run(
        out / "resumed-world1",
        3,
        "--per-device-batch",
        "2",
        "--grad-accum",
        "2",
        "--resume-from-checkpoint",
        str(out / "stage3" / f"checkpoint-{SAVE}"),
    )
    base = json.loads((out / "stage0" / "trainer_state.json").read_text())["log_history"]
    want = {s: v for s, v in _per_step(base).items() if s > SAVE}
    got = {s: v for s, v in _per_step(resumed.state.log_history).items() if s > SAVE}
    _assert_same_steps(got, want, "2-rank checkpoint resumed on 1 rank")
    _assert_same_weights(out / "resumed-world1", out / "stage0", "resumed on 1 rank")


@pytest.mark.slow
def test_trainer_stages_match_ddp_and_resume(tmp_path: Path) -> None:
    (tmp_path / "ds_config.json").write_text(json.dumps(HF_DOCS_ZERO3))
    run_ranks(_train_all_stages, 2, str(tmp_path), timeout_s=300)
    run_ranks(_resume_on_one_rank, 1, str(tmp_path), timeout_s=120)


def test_trainer_precision_arguments_checked() -> None:
    from types import SimpleNamespace

    import torch

    from zeroshard.engine.huggingface._trainer import _resolve_precision

    def args(bf16: bool = False, fp16: bool = False) -> Any:
        return SimpleNamespace(bf16=bf16, fp16=fp16)

    with pytest.raises(ValueError, match=r"fp16=True\) is not supported"):
        _resolve_precision({"stage": 2}, args(fp16=True))
    with pytest.raises(ValueError, match="make them agree"):
        _resolve_precision({"stage": 2, "compute_dtype": "fp32"}, args(bf16=True))
    assert (
        _resolve_precision({"stage": 3}, args(bf16=True)).precision.compute_dtype == torch.bfloat16
    )
    assert _resolve_precision(None, args()).precision.compute_dtype == torch.float32


def test_trainer_ds_config_checked_against_training_arguments(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import transformers

    from zeroshard.engine.huggingface import ZeroTrainer

    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import hf_trainer

    args = hf_trainer.parse_args(["--output-dir", str(tmp_path / "out"), "--per-device-batch", "2"])
    training_args = hf_trainer.build_training_args(args)
    model = hf_trainer.build_model(args)

    def trainer(**kw: Any) -> ZeroTrainer:
        return ZeroTrainer(model=model, args=training_args, **kw)

    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(HF_DOCS_ZERO3))
    with caplog.at_level("INFO", logger="zeroshard.engine.huggingface"):
        cfg = trainer(ds_config=path).zero_config
    assert (cfg.stage, cfg.comm.reduce_bucket_bytes) == (3, 64 * 64 * 4)  # h*h fp32 elements
    assert [r.message for r in caplog.records].count(
        "ds_config optimizer: not honoured (zeroshard builds no optimizer: the torch "
        "optimizer passed to initialize() is used)"
    ) == 1
    mismatches = {
        "train_micro_batch_size_per_gpu": 4,  # per_device_train_batch_size is 2
        "train_batch_size": 3,  # 1 rank x 2 x accumulation 1
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,  # max_grad_norm is 1.0
    }
    for key, value in mismatches.items():
        with pytest.raises(ValueError, match=rf"^{key}={value} .*in the DeepSpeed config but"):
            trainer(ds_config={**HF_DOCS_ZERO3, key: value})
    with pytest.raises(ValueError, match=r"^bf16.enabled=True .*in the DeepSpeed config but"):
        trainer(ds_config={**HF_DOCS_ZERO3, "bf16": {"enabled": True}})
    with pytest.raises(ValueError, match="zero_config or ds_config, not both"):
        trainer(ds_config=path, zero_config={"stage": 3})
    ds_args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "ds"),
        use_cpu=True,
        report_to="none",
        deepspeed={"zero_optimization": {"stage": 2}},
    )
    with pytest.raises(ValueError, match=r"TrainingArguments\(deepspeed=...\) would start"):
        ZeroTrainer(model=model, args=ds_args, zero_config={"stage": 2})
    fsdp_args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "fsdp"), use_cpu=True, report_to="none", fsdp=True
    )
    with pytest.raises(ValueError, match=r"TrainingArguments\(fsdp=...\) asks accelerate"):
        ZeroTrainer(model=model, args=fsdp_args, zero_config={"stage": 3})
    # torch_compile compiles the blocks `_no_split_modules` names: none is refused at once.
    compile_args = hf_trainer.build_training_args(
        hf_trainer.parse_args(["--output-dir", str(tmp_path / "c"), "--torch-compile", "eager"])
    )
    assert compile_args.torch_compile
    model._no_split_modules = None
    with pytest.raises(ValueError, match=r"names none that it holds"):
        ZeroTrainer(model=model, args=compile_args, zero_config={"stage": 3})


def _best_model_at_end(root: str) -> None:
    import torch
    import transformers

    import zeroshard.engine as zs
    from zeroshard.engine.huggingface import ZeroTrainer

    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import hf_trainer

    args = hf_trainer.parse_args(["--output-dir", root, "--hidden", str(HIDDEN)])
    training_args = transformers.TrainingArguments(
        output_dir=root,
        max_steps=6,
        per_device_train_batch_size=2,
        learning_rate=3e-3,
        use_cpu=True,
        report_to="none",
        eval_strategy="steps",
        eval_steps=2,
        save_steps=2,
        load_best_model_at_end=True,
        # The highest eval loss is the best: the first checkpoint, not the last weights.
        metric_for_best_model="eval_loss",
        greater_is_better=True,
    )
    saved: dict[int, dict[str, Any]] = {}

    class Snapshot(transformers.TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            saved[state.global_step] = zs.full_state_dict(kw["model"])

    trainer = ZeroTrainer(
        model=hf_trainer.build_model(args),
        args=training_args,
        train_dataset=hf_trainer.StrideSequences(64, args.seq_len, 1),
        eval_dataset=hf_trainer.StrideSequences(8, args.seq_len, 2),
        zero_config={"stage": 3},
        callbacks=[Snapshot()],
    )
    trainer.train()
    assert trainer.state.best_model_checkpoint == str(Path(root) / "checkpoint-2"), (
        trainer.state.best_model_checkpoint
    )
    final = zs.full_state_dict(trainer.model)
    assert not all(torch.equal(final[k], v) for k, v in saved[6].items()), "the last weights"
    for k, v in saved[2].items():
        assert torch.equal(final[k], v), f"load_best_model_at_end: {k} is not checkpoint-2's"
    _ranks_seeing_different_files(trainer, Path(root))


def _ranks_seeing_different_files(trainer: Any, root: Path) -> None:
    """Ranks that see different checkpoint files (no shared filesystem) all raise,
    naming who sees what, instead of waiting on each other or loading apart."""
    import shutil

    import torch.distributed as dist

    rank = dist.get_rank()
    best = root / "checkpoint-2"
    # As rank 1 would see it: a checkpoint without zeroshard's state, or without the
    # LR scheduler's.
    no_state, no_scheduler = root / "no-state", root / "no-scheduler"
    if rank == 0:
        no_state.mkdir()
        shutil.copytree(best, no_scheduler)
        (no_scheduler / "scheduler.pt").unlink()
    dist.barrier()
    mine = best if rank == 0 else no_state
    trainer.state.best_model_checkpoint = str(mine)
    with pytest.raises(FileNotFoundError, match=r"ranks \[0\] see .* but ranks \[1\] do not"):
        trainer._load_best_model()
    with pytest.raises(FileNotFoundError, match=r"ranks \[0\] see .* but ranks \[1\] do not"):
        trainer._load_optimizer_and_scheduler(str(mine))
    mine = best if rank == 0 else no_scheduler
    with pytest.raises(FileNotFoundError, match=r"scheduler.pt but ranks \[1\] do not"):
        trainer._load_optimizer_and_scheduler(str(mine))


def test_trainer_loads_the_best_model_at_end(tmp_path: Path) -> None:
    run_ranks(_best_model_at_end, 2, str(tmp_path), timeout_s=120)


def _undistributed_refused_and_resume_into_output_dir(root: str) -> None:
    import transformers

    from zeroshard.engine.huggingface import ZeroTrainer

    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import hf_trainer

    out = Path(root) / "out"
    args = hf_trainer.parse_args(["--output-dir", str(out)])
    # Without use_cpu=True transformers counts one process on a CPU-only machine: each
    # rank would train on the whole dataset (the docs' snippet did, rc 0).
    plain = transformers.TrainingArguments(output_dir=str(out), report_to="none")
    assert plain.world_size == 1
    with pytest.raises(ValueError, match=r"has 2 ranks but TrainingArguments counts 1 .*use_cpu"):
        ZeroTrainer(model=hf_trainer.build_model(args), args=plain, zero_config={"stage": 2})
    # Resumed into its own output folder, the run writes checkpoint-4 again, as the
    # Trainer does (it raised OutputExistsError there), and repeats steps 3-4.
    steps = ["--stage", "2", "--cpu", "--max-steps", "4", "--save-steps", "2"]
    first = _per_step(hf_trainer.main([*steps, "--output-dir", str(out)]).state.log_history)
    again = hf_trainer.main(
        [*steps, "--output-dir", str(out), "--resume-from-checkpoint", str(out / "checkpoint-2")]
    )
    got = {s: v for s, v in _per_step(again.state.log_history).items() if s > 2}
    _assert_same_steps(got, {s: v for s, v in first.items() if s > 2}, "resumed into its output")


def test_trainer_refuses_undistributed_args_and_resumes_into_its_output_dir(
    tmp_path: Path,
) -> None:
    run_ranks(_undistributed_refused_and_resume_into_output_dir, 2, str(tmp_path), timeout_s=120)
