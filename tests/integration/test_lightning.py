"""zeroshard's Lightning strategies against Lightning's own DDP, on gloo ranks.

One spawn of 2 ranks fits the same LightningModule (accumulate_grad_batches=2,
gradient_clip_val that clips, a per-step LR schedule, ModelCheckpoint top-2 and last,
validation, then `trainer.test`) with `strategy="ddp"` and with zeroshard at stages 1, 2
and 3 (stage 3 also with `configure_model` built on the meta device): every logged
train/val/test loss and the logged `grad_norm` (DDP's: torch's norm of the averaged
gradients) must agree at every step, to fp32 reduction-order noise (rel 1e-5), and
ModelCheckpoint must keep the same checkpoints; each run then resumes from its own
checkpoint and must log what DDP's resumed run logs. bf16-mixed, 16-mixed (the engine's
loss scaling: the grad norm catches a double scaling) and bf16-true are checked against
the fp32 run at stage 3, and Fabric (setup, backward, clip_gradients, save and load) at
stage 3 against Fabric's DDP. Spawns of 1 and 3 ranks resume the 2-rank checkpoints
(the Trainer's and Fabric's) against DDP resumed from its own at that size, test from
one without fitting, check the refusals and the model summary of a stage-3 model (the
unsharded module's counts); `zeroshard-ckpt consolidate` turns a
Lightning checkpoint into safetensors equal to DDP's weights at that step.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests._dist import run_each, run_ranks, subtests

pytest.importorskip("lightning")

ROOT = Path(__file__).resolve().parents[2]


def _kept(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".ckpt"))


def _first_kept(directory: Path) -> Path:
    """The earliest step checkpoint ModelCheckpoint kept (not last.ckpt)."""
    steps = [n for n in _kept(directory) if n.startswith("step=")]
    return directory / min(steps, key=lambda n: int(n[5:-5]))


def _zs(stage: int, **extra: Any) -> Any:
    from tests.integration._lightning import UNITS
    from zeroshard.engine.lightning import ZeroShardStrategy

    return ZeroShardStrategy(config={"stage": stage, **(UNITS if stage == 3 else {}), **extra})


def _resumed(rows: dict[int, dict[str, float]], after: int) -> dict[int, dict[str, float]]:
    return {s: r for s, r in rows.items() if s > after}


def _at_two(root: str) -> None:
    import torch
    import torch.distributed as dist

    import zeroshard.engine as zs
    from tests.integration._lightning import UNITS, assert_rows_equal, fabric_run, fit
    from zeroshard.engine.lightning import (
        ZeroShardFabricStrategy,
        ZeroShardPrecision,
        ZeroShardStrategy,
    )

    out = Path(root)
    ddp, _, _ = fit("ddp", out / "ddp")
    assert all("grad_norm" in ddp[s] and "train_loss" in ddp[s] for s in range(1, 6)), ddp
    assert any("val_loss" in r for r in ddp.values()) and "test_loss" in ddp[6], ddp
    start = _first_kept(out / "ddp")
    step = int(start.name[5:-5])
    ddp_resumed, _, _ = fit("ddp", out / "ddp-resumed", ckpt_path=start, ckpt=False)
    meta, _, _ = fit("ddp", out / "ddp-meta", ckpt=False, in_configure_model=True)

    def stage_case(stage: int) -> None:
        where = out / f"stage{stage}"
        rows, model, _ = fit(_zs(stage), where)
        assert_rows_equal(rows, ddp)
        assert _kept(where) == _kept(out / "ddp")
        assert (where / "last.ckpt" / "latest").is_file(), sorted((where / "last.ckpt").iterdir())
        state = zs.engine_state(model)
        assert state.config.stage == stage and len(state.optimizer.param_groups) == 1
        resumed, _, _ = fit(_zs(stage), out / f"stage{stage}-resumed", ckpt_path=where / start.name)
        assert_rows_equal(_resumed(resumed, step), _resumed(ddp_resumed, step))

    def deepspeed_case() -> None:
        # A ds_config.json as DeepSpeed users write it: "auto" filled from the Trainer.
        config = {
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "bf16": {"enabled": "auto"},
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "train_micro_batch_size_per_gpu": "auto",
        }
        path = out / "ds_config.json"
        if dist.get_rank() == 0:
            path.write_text(json.dumps(config))
        dist.barrier()
        rows, model, _ = fit(ZeroShardStrategy(str(path)), out / "zs-ds", ckpt=False)
        cfg = zs.engine_state(model).config
        assert (cfg.stage, cfg.stage3.persistence_threshold) == (3, 0), cfg
        assert_rows_equal(rows, ddp)  # no ModelCheckpoint here: saving changes no step

    def meta_case() -> None:
        rows, model, _ = fit(_zs(3), out / "zs-meta", ckpt=False, in_configure_model=True)
        assert model.built_on == [torch.device("meta")], model.built_on
        assert_rows_equal(rows, meta)

    def precision_case(precision: str) -> None:
        reference, _, _ = fit(_zs(3), out / "fp32", ckpt=False)
        options: dict[str, Any] = {"precision": precision}
        extra = {}
        if precision == "16-mixed":  # on CPU the flag would become bf16-mixed
            options = {"plugins": [ZeroShardPrecision("16-mixed")]}
            extra = {"initial_loss_scale": 2.0**8}  # no overflow to skip a step on
        rows, model, _ = fit(_zs(3, **extra), out / precision, ckpt=False, **options)
        state = zs.engine_state(model)
        want = torch.float16 if precision == "16-mixed" else torch.bfloat16
        assert state.config.precision.compute_dtype == want
        assert (state.optimizer.scaler is not None) == (precision == "16-mixed")
        full = model.zeroshard_module.state_dict()
        kept = torch.bfloat16 if precision == "bf16-true" else torch.float32
        assert {v.dtype for v in full.values()} == {kept}, {k: v.dtype for k, v in full.items()}
        for s, metrics in reference.items():
            for name, value in metrics.items():
                assert abs(rows[s][name] - value) <= 3e-2 * abs(value) + 1e-3, (s, name, rows[s])

    def manual_case() -> None:
        manual = {"manual": True, "accumulate_grad_batches": 1, "gradient_clip_val": None}
        want, _, _ = fit("ddp", out / "ddp-manual", ckpt=False, **manual)
        got, _, _ = fit(_zs(2), out / "zs-manual", ckpt=False, **manual)
        # DDP's reference norm is taken after the user's own clip_gradients: compare the loss.
        assert all("grad_norm" in got[s] for s in range(1, 6)), got
        losses = {s: {"train_loss": r["train_loss"]} for s, r in got.items() if "train_loss" in r}
        assert_rows_equal(
            losses,
            {s: {"train_loss": r["train_loss"]} for s, r in want.items() if "train_loss" in r},
        )

    def fabric_meta_case() -> None:
        zs3 = ZeroShardFabricStrategy(config={"stage": 3, **UNITS})
        base = fabric_run("ddp", out / "fabric-ddp-det", steps=2, empty_init=False)
        got = fabric_run(zs3, out / "fabric-zs-meta", steps=2, empty_init=True)
        assert got == pytest.approx(base, rel=1e-6), (got, base)

    def fabric_case() -> None:
        zs3 = ZeroShardFabricStrategy(config={"stage": 3, **UNITS})
        base = fabric_run("ddp", out / "fabric-ddp", steps=4, save_at=2)
        got = fabric_run(zs3, out / "fabric-zs", steps=4, save_at=2)
        assert got == pytest.approx(base, rel=1e-6), (got, base)
        ckpt = out / "fabric-zs" / "fabric.ckpt"
        again = fabric_run(
            ZeroShardFabricStrategy(config={"stage": 3, **UNITS}), out, steps=4, load=ckpt
        )
        assert again == pytest.approx(base[2:], rel=1e-6), (again, base)

    cases: list[dict[str, Any]] = [
        *({"kind": "stage", "arg": s} for s in (1, 2, 3)),
        {"kind": "meta", "arg": None},
        {"kind": "deepspeed", "arg": None},
        *({"kind": "precision", "arg": p} for p in ("bf16-mixed", "16-mixed", "bf16-true")),
        {"kind": "fabric", "arg": None},
        {"kind": "manual", "arg": None},
        {"kind": "fabric_meta", "arg": None},
    ]

    def body(kind: str, arg: Any) -> None:
        if kind == "stage":
            stage_case(arg)
        elif kind == "meta":
            meta_case()
        elif kind == "deepspeed":
            deepspeed_case()
        elif kind == "precision":
            precision_case(arg)
        elif kind == "manual":
            manual_case()
        elif kind == "fabric_meta":
            fabric_meta_case()
        else:
            fabric_case()

    run_each(cases, body)


def _elsewhere(root: str) -> None:
    """At 1 or 3 ranks: the 2-rank checkpoints resumed, as DDP resumes its own."""
    import torch.distributed as dist

    from tests.integration._lightning import UNITS, assert_rows_equal, fabric_run, fit
    from zeroshard.engine.lightning import ZeroShardFabricStrategy

    out = Path(root)
    world = dist.get_world_size()
    start = _first_kept(out / "ddp")
    step = int(start.name[5:-5])
    ddp, _, _ = fit("ddp", out / f"ddp-at-{world}", ckpt_path=start, ckpt=False)
    rows, _, _ = fit(_zs(3), out / f"zs-at-{world}", ckpt_path=out / "stage3" / start.name)
    assert_rows_equal(_resumed(rows, step), _resumed(ddp, step))
    ddp_fabric = fabric_run("ddp", out, steps=4, load=out / "fabric-ddp" / "fabric.ckpt")
    zs3 = ZeroShardFabricStrategy(config={"stage": 3, **UNITS})
    zs_fabric = fabric_run(zs3, out, steps=4, load=out / "fabric-zs" / "fabric.ckpt")
    assert zs_fabric == pytest.approx(ddp_fabric, rel=1e-6), (zs_fabric, ddp_fabric)


def _test_only(root: str) -> None:
    """`trainer.test(ckpt_path=...)` on a fresh module, without a fit: the engine is built
    for evaluation, loads the shards, and tests what DDP tests from its checkpoint."""
    from tests.integration._lightning import Net, assert_rows_equal, loader, trainer

    out = Path(root)
    start = _first_kept(out / "ddp")
    results = []
    for strategy, ckpt in (("ddp", start), (_zs(3), out / "stage3" / start.name)):
        t, rec = trainer(strategy, out / "test-only", steps=1, ckpt=False)
        t.test(Net(), loader(16, seed=3), ckpt_path=ckpt, verbose=False)
        results.append(rec.rows)
    assert_rows_equal(results[1], results[0])


def _summary(root: str) -> None:
    """Lightning's model summary counts a stage-3 model's parameters at their full size, as
    for the unsharded module (it counted 0: outside forward a parameter is empty)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelSummary
    from lightning.pytorch.utilities.model_summary import summarize

    from tests._logs import logged
    from tests.integration._lightning import Net, loader

    want = summarize(Net(), max_depth=1)
    assert want.total_parameters > 0
    t = pl.Trainer(
        strategy=_zs(3),
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[ModelSummary(max_depth=1)],
        default_root_dir=root,
    )
    with logged("lightning.pytorch.callbacks.model_summary") as lines:
        t.fit(Net(), loader())
    shown = "\n".join(lines)
    assert re.search(rf"^{want.total_parameters} +Total params$", shown, re.M), shown
    got = next(c for c in t.callbacks if isinstance(c, ModelSummary))._summary(
        t, t.lightning_module
    )
    assert (got.total_parameters, got.trainable_parameters) == (
        want.total_parameters,
        want.trainable_parameters,
    )
    assert dict(zip(got.layer_names, got.param_nums, strict=True)) == dict(
        zip(want.layer_names, want.param_nums, strict=True)
    )


def _refusals(root: str) -> None:
    """Bad input gets an error naming it, on every rank."""
    import torch

    from tests.integration._lightning import Net, loader, trainer
    from zeroshard.engine.lightning import ZeroShardFabricStrategy, ZeroShardStrategy

    out = Path(root)

    class TwoOptimizers(Net):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def configure_optimizers(self) -> Any:
            return [torch.optim.SGD(self.parameters(), lr=0.1)] * 2

    class OddHyperparameters(Net):
        def __init__(self) -> None:
            super().__init__()
            self.save_hyperparameters({"activation": torch.nn.Tanh()})

    class SkipsBatches(Net):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return None

    ddp_file = _first_kept(out / "ddp")
    manual = {"gradient_clip_val": None, "accumulate_grad_batches": 1}
    ds_accum = {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4}
    ds_bf16 = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    cases = [
        (ZeroShardStrategy({"compute_dtype": "bf16"}), Net, {}, "precision='32-true'"),
        (ZeroShardStrategy(ds_accum), Net, {}, "gradient_accumulation_steps=4"),
        (ZeroShardStrategy(ds_bf16), Net, {}, "bf16.enabled=True"),
        (ZeroShardStrategy(), Net, {"gradient_clip_algorithm": "value"}, "global norm only"),
        (ZeroShardStrategy(), TwoOptimizers, manual, "returned 2 optimizers"),
        (ZeroShardStrategy(), SkipsBatches, {}, "returned None"),
        (ZeroShardStrategy(), Net, {"sync_batchnorm": True}, "sync_batchnorm=True"),
        (ZeroShardStrategy(), Net, {"ckpt_path": ddp_file}, str(ddp_file)),
        (ZeroShardStrategy(), OddHyperparameters, {"ckpt": True}, "['hyper_parameters']"),
    ]

    def body(index: int) -> None:
        strategy, model_class, options, wanted = cases[index]
        ckpt_path = options.pop("ckpt_path", None)
        ckpt = options.pop("ckpt", False)
        t, _ = trainer(strategy, out / f"refused-{index}", steps=2, ckpt=ckpt, **options)
        with pytest.raises((ValueError, RuntimeError, OSError, TypeError)) as err:
            t.fit(model_class(), loader(), ckpt_path=ckpt_path)
        assert wanted in str(err.value), str(err.value)

    run_each([{"index": i} for i in range(len(cases))], body)

    # Evaluation first builds an engine without the optimizer: a fit on it is refused.
    model = Net()
    t, _ = trainer(_zs(2), out / "refused", steps=2, ckpt=False)
    t.validate(model, loader(16, seed=2), verbose=False)
    with pytest.raises(ValueError, match="sharded for evaluation only"):
        t.fit(model, loader())
    t, _ = trainer(_zs(3), out / "refused", steps=2, ckpt=False)
    with pytest.raises(ValueError, match="sharded before with another config"):
        t.validate(model, loader(16, seed=2), verbose=False)

    from lightning.fabric import Fabric

    fabric = Fabric(strategy=ZeroShardFabricStrategy(), accelerator="cpu", devices=1)
    fabric.launch()
    net = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="together"):
        fabric.setup_optimizers(torch.optim.SGD(net.parameters(), lr=0.1))
    evaluated = fabric.setup(torch.nn.Linear(4, 4))  # no optimizer: for evaluation
    assert torch.isfinite(evaluated(torch.ones(2, 4))).all()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = fabric.setup(net, opt)
    fabric.backward(net(torch.ones(2, 4)).sum())
    with pytest.raises(ValueError, match="global norm only"):
        fabric.clip_gradients(net, opt, clip_val=1.0)


def _at_one(root: str) -> None:
    run_each(
        subtests({"part": [_elsewhere, _test_only, _refusals, _summary]}),
        lambda part: part(root),
    )


def test_lightning_trainer_and_fabric(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from zeroshard.ckpt._cli import main

    run_ranks(_at_two, 2, str(tmp_path), timeout_s=300)
    run_ranks(_at_one, 1, str(tmp_path), timeout_s=300)
    run_ranks(_elsewhere, 3, str(tmp_path), timeout_s=300)
    start = _first_kept(tmp_path / "ddp")
    out = tmp_path / "consolidated"
    assert main(["consolidate", str(tmp_path / "stage3" / start.name), str(out), "--quiet"]) == 0
    got = load_file(out / "model.safetensors")
    want = torch.load(start, weights_only=False)["state_dict"]
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_example_under_lightnings_own_launcher(tmp_path: Path) -> None:
    """examples/lightning_gpt.py started by `python`: Lightning starts the second rank, the
    fit checkpoints (a sharded directory) and ends."""
    cmd = [sys.executable, str(ROOT / "examples" / "lightning_gpt.py"), "--devices", "2"]
    cmd += ["--strategy", "zeroshard_stage_3", "--steps", "2", "--batch", "2", "--seq-len", "32"]
    cmd += ["--ckpt-dir", str(tmp_path), "--save-every", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "last.ckpt" / "latest").is_file(), sorted(tmp_path.rglob("*"))
    assert (tmp_path / "step=2.ckpt" / "checkpoint" / "metadata.json").is_file()


def test_registry_precision_and_imports() -> None:
    """Importing the package registers the names for the Trainer and Fabric; a precision
    the engine cannot take is refused by name when the Trainer is built; importing
    zeroshard.engine alone imports no Lightning."""
    import lightning.pytorch as pl
    from lightning.fabric import Fabric

    import zeroshard.engine.lightning as zl

    for name, (_, config) in zl.STRATEGIES.items():
        t = pl.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False)
        assert type(t.strategy) is zl.ZeroShardStrategy and t.strategy._config_source == config
        f = Fabric(strategy=name, accelerator="cpu", devices=1)
        assert type(f.strategy) is zl.ZeroShardFabricStrategy
    assert zl.STRATEGIES["zeroshard_stage_3_offload"][1] == {
        "stage": 3,
        "offload_optimizer": True,
        "offload_params": True,
    }
    t = pl.Trainer(strategy="zeroshard", accelerator="cpu", devices=1, precision="bf16-mixed")
    assert isinstance(t.strategy.precision_plugin, zl.ZeroShardPrecision)
    assert t.strategy.precision_plugin.precision == "bf16-mixed"
    for precision in ("64-true", "16-true"):
        with pytest.raises(ValueError, match=f"precision='{precision}' is not supported"):
            pl.Trainer(strategy="zeroshard", accelerator="cpu", devices=1, precision=precision)
        with pytest.raises(ValueError, match=f"precision='{precision}' is not supported"):
            Fabric(strategy="zeroshard", accelerator="cpu", devices=1, precision=precision)
    code = "import sys, zeroshard.engine; sys.exit('lightning' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


_NO_IMPORT = """
import site, sys
site.addsitedir(sys.argv[1])  # what the interpreter does with the installed .pth line
import lightning.pytorch as pl
from lightning.fabric import Fabric
assert "zeroshard.engine.lightning" not in sys.modules  # not imported until chosen
t = pl.Trainer(strategy="zeroshard_stage_3", accelerator="cpu", devices=1, logger=False)
f = Fabric(strategy="zeroshard_stage_2_offload", accelerator="cpu", devices=1)
import zeroshard.engine.lightning as zl  # its classes take the names' place, quietly
assert type(t.strategy) is zl.ZeroShardStrategy, type(t.strategy)
assert t.strategy._config_source == {"stage": 3}, t.strategy._config_source
assert type(f.strategy) is zl.ZeroShardFabricStrategy, type(f.strategy)
assert pl.strategies.StrategyRegistry["zeroshard"]["strategy"] is zl.ZeroShardStrategy
print("ok")
"""


def test_strategy_names_resolve_without_importing_the_package() -> None:
    """The engine's .pth line registers the names when Lightning loads: forgetting
    `import zeroshard.engine.lightning` gave Lightning's "invalid strategy name"."""
    import _zeroshard_lightning

    from zeroshard.engine.lightning import STRATEGIES

    assert _zeroshard_lightning.STRATEGIES is STRATEGIES  # one table
    src = ROOT / "packages" / "engine" / "src"
    assert (src / "zeroshard_engine_lightning.pth").read_text() == "import _zeroshard_lightning\n"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", _NO_IMPORT, str(src)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
