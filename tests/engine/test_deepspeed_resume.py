"""Resume a DeepSpeed ZeRO run in zeroshard, against DeepSpeed itself.

The fixtures (`tests/ckpt/fixtures/deepspeed/resume_*`, made by make_fixtures.py with
DeepSpeed 0.19.8 through `nox -s peers`): DeepSpeed trained TinyLM with AdamW for 2
steps at world size 2 and saved, then trained 2 more steps on stored batches; its
losses and fp32 weights after them are the reference. Here zeroshard loads the
checkpoint at world 2 and 3 into a model initialised differently (and an optimizer
with another lr), trains the same 2 steps on the same global batches, and must agree:
fp32 losses to rtol 1e-6 and weights to atol 1e-6 (measured on CPU: identical at world 2,
2.4e-7 at world 3, where the gradient reduction order differs from DeepSpeed's); fp16
(DeepSpeed's loss-scaled ZeRO-2) losses to rtol 1e-4 and weights to atol 1e-3
(measured: 1.9e-5 and 1.7e-4 at world 3; fp16 gradients are rounded and reduced
differently).

The tied cases (`resume_tied_*`: residual MLP blocks, the head tied to the embedding,
`_frozen`: the tied weight frozen) resume to DeepSpeed's continuation at stages 1-3,
worlds 1-3 and across stages; before any step, every trainable name's Adam moments and
step (tied names included) must equal what DeepSpeed's live optimizer held at the
checkpoint (`moments.safetensors`, read through `safe_get_full_optimizer_state`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import zeroshard.engine as zs
from tests._dist import run_ranks
from zeroshard.ckpt import ModelMismatchError
from zeroshard.ckpt._cli import main
from zeroshard.ckpt._names import canonical_name
from zeroshard.comm import Group

FIXTURES = Path(__file__).resolve().parents[1] / "ckpt" / "fixtures" / "deepspeed"
CASES = ["resume_stage1", "resume_stage2", "resume_stage3", "resume_stage2_fp16"]
# TiedLM compiled whole (`torch.compile(model)`) before deepspeed.initialize.
COMPILED = "resume_compiled_stage2"
# DeepSpeed's own Muon (make_fixtures.MUON_CASES).
MUON = "resume_muon_stage2"
TIED = [
    "resume_tied_stage1",
    "resume_tied_stage2",
    "resume_tied_stage3",
    "resume_tied_frozen_stage2",
    "resume_tied_frozen_stage3",
]


def _fixture_module() -> Any:
    sys.path.insert(0, str(FIXTURES))
    try:
        import make_fixtures
    finally:
        sys.path.remove(str(FIXTURES))
    return make_fixtures


def _optimizer(
    model: torch.nn.Module, several: bool = False, muon: bool = False
) -> torch.optim.Optimizer | list[torch.optim.Optimizer]:
    """The groups of the DeepSpeed run, but lr 1e-3: the checkpoint's 1e-2 must be taken;
    `several`: the 2-D weights of the blocks in an AdamW of their own (each parameter's
    Adam state then goes to the optimizer that owns it); `muon`: in torch's Muon (the
    momentum 0.5: the checkpoint's must be taken), as DeepSpeed's Muon cases train."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    several = several or muon
    own = [p for n, p in trainable if several and n.startswith("blocks") and p.dim() == 2]
    rest = [(n, p) for n, p in trainable if all(p is not q for q in own)]
    decay = [p for n, p in rest if "norm" not in n]
    no_decay = [p for n, p in rest if "norm" in n]
    adamw = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-3,
    )
    if muon:
        return [torch.optim.Muon(own, lr=1e-3, momentum=0.5, adjust_lr_fn="original"), adamw]
    if not several:
        return adamw
    return [torch.optim.AdamW(own, lr=1e-3, weight_decay=0.1, betas=(0.8, 0.9)), adamw]


def _build(
    case: str, stage: int | None = None, kind: str | None = None, several: bool = False
) -> tuple[torch.nn.Module, zs.ZeroOptimizer, Any]:
    """The case's model (or the model `kind` of make_fixtures.MODELS) under zeroshard at
    the case's ZeRO stage (or `stage`), with several optimizers if `several`."""
    mf = _fixture_module()
    ref = json.loads((FIXTURES / case / "resume.json").read_text())
    torch.manual_seed(99)  # not DeepSpeed's seed: every weight must come from the checkpoint
    if kind is None:
        (kind,) = [k for name, _, _, k in mf.RESUME_CASES if name == case]
    model = mf.MODELS[kind]()
    stage = ref["stage"] if stage is None else stage
    cfg: dict[str, Any] = {"stage": stage}
    if case.endswith("_fp16"):
        cfg.update(compute_dtype="fp16", initial_loss_scale=2.0**16)
    if stage == 3:
        cfg.update(min_unit_params=1, persistence_threshold=0)
    muon = case in mf.MUON_CASES
    model, opt = zs.initialize(model, _optimizer(model, several, muon), cfg)
    return model, opt, mf


def _resume(
    case: str, source: Path, stage: int | None, kind: str | None = None, several: bool = False
) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = json.loads((FIXTURES / case / "resume.json").read_text())
    model, opt, mf = _build(case, stage, kind, several)
    assert zs.load_checkpoint(model, opt, source) == 2
    assert all(pg["lr"] == 1e-2 for pg in opt.param_groups), "lr comes from the checkpoint"
    fp16 = case.endswith("_fp16")
    if fp16:
        assert opt.scaler is not None and opt.scaler.scale == 256.0, "DeepSpeed's loss scale"
    losses = []
    for batch in torch.tensor(ref["batches"]):
        per_rank = batch.shape[0] // world
        tokens = batch[rank * per_rank : (rank + 1) * per_rank]
        loss = mf.rank_loss(model(tokens), tokens)
        loss.backward()
        if ref["clip"]:
            opt.clip_grad_norm_(ref["clip"])
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    # Muon: torch's and DeepSpeed's Newton-Schulz (its muon_update compiled by inductor)
    # both run in bf16 but round differently, up to 5% of an update's largest element on
    # a random 29 x 13 matrix; the lr scales that into the weights. Measured: losses 4.7e-4
    # apart, weights 2.0e-3; with the momentum not loaded, 0.13 and 1.0e-2.
    muon = case in mf.MUON_CASES
    loss_rtol = 1e-4 if fp16 else 2e-3 if muon else 1e-6
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(ref["losses"]), rtol=loss_rtol, atol=0
    )
    # DeepSpeed's names, as the model's code spells them (a model compiled before
    # deepspeed.initialize saved them under `_orig_mod.`).
    want = {
        canonical_name(k): v
        for k, v in load_file(FIXTURES / case / "continued.safetensors").items()
    }
    got = zs.full_state_dict(model)
    atol = 4e-3 if muon else 1e-3 if fp16 else 1e-6
    for name, value in want.items():
        assert name in got, f"{case}: {name} missing"
        if name in ("scale", "seen"):
            continue  # buffers: `seen` counts each rank's own tokens
        # Frozen parameters stay in the dtype DeepSpeed kept them in (fp16 here).
        torch.testing.assert_close(
            got[name].to(value.dtype), value, rtol=0, atol=atol, msg=lambda m: f"{case}: {m}"
        )


def _resume_all(runs: list[tuple[str, str, int | None]]) -> None:
    for case, source, stage in runs:
        _resume(case, Path(source), stage)


def _resume_compiled(runs: list[tuple[int, str]]) -> None:
    for stage, kind in runs:
        _resume(COMPILED, FIXTURES / COMPILED, stage, kind)


def _adam_state_by_name(model: torch.nn.Module, opt: zs.ZeroOptimizer) -> dict[str, Any]:
    """name -> {exp_avg, exp_avg_sq: full tensors, step: float} of every trainable
    parameter, under each of its names (collective: one all-gather per state tensor)."""
    by_param: dict[int, dict[str, Any]] = {}
    for g in zs.engine_state(model).groups:
        if not g.trainable:
            continue
        state = opt.inner.state[g.master]
        for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
            if key not in state:
                continue
            full = torch.empty(g.layout.padded_numel, dtype=torch.float32)
            g.process_group.all_gather_into(full, state[key].detach(), label=key).wait()
            for p, slot in zip(g.params, g.layout.slots, strict=True):
                step = {"step": float(state["step"])} if "step" in state else {}
                entry = by_param.setdefault(id(p), step)
                entry[key] = full[slot.offset : slot.end].view(slot.shape).clone()
    return {
        name: by_param[id(p)]
        for name, p in model.named_parameters(remove_duplicate=False)
        if id(p) in by_param
    }


@contextlib.contextmanager
def _gathers() -> Iterator[list[str]]:
    """The labels of the all-gathers issued inside (each still runs); a flat group's
    gathers name it ("state_dict of group 3")."""
    labels: list[str] = []
    gather = Group.all_gather_into

    def counted(self: Group, output: Any, input: Any, *, label: str = "") -> Any:
        labels.append(label)
        return gather(self, output, input, label=label)

    Group.all_gather_into = counted  # type: ignore[method-assign]
    try:
        yield labels
    finally:
        Group.all_gather_into = gather  # type: ignore[method-assign]


def _loaded_moments(runs: list[tuple[str, int]], several: bool = False) -> None:
    for case, stage in runs:
        ref = json.loads((FIXTURES / case / "resume.json").read_text())
        want = load_file(FIXTURES / case / "moments.safetensors")
        model, opt, _ = _build(case, stage, several=several)
        with _gathers() as gathers:
            zs.load_checkpoint(model, opt, FIXTURES / case)
        if stage == 3:  # each rank reads its own shard: no flat group is gathered whole
            whole = [label for label in gathers if " of group " in label]
            assert whole == [], f"{case} at stage 3: the resume gathered {whole}"
        got = _adam_state_by_name(model, opt)
        names = {k.split("/", 1)[1] for k in want}
        assert set(got) == names, f"{case}: {sorted(set(got) ^ names)}"
        assert {"embed.weight", "head.weight"} <= names or "frozen" in case, case
        for name, state in got.items():
            keys = [k.split("/", 1)[0] for k in want if k.split("/", 1)[1] == name]
            assert sorted(keys) == sorted(k for k in state if k != "step"), (case, name, keys)
            if "exp_avg" in keys:
                assert state["step"] == ref["adam_step"], f"{case} at stage {stage}: {name}"
            for key in keys:
                assert torch.equal(state[key], want[f"{key}/{name}"]), (
                    f"{case} at stage {stage}: {key} of {name}"
                )


@pytest.mark.parametrize("world", [1, 2, 3])
def test_tied_moments_equal_deepspeeds_before_any_step(world: int) -> None:
    runs = [(case, stage) for case in TIED for stage in (1, 2, 3)]
    run_ranks(_loaded_moments, world, runs)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_tied_resume_matches_deepspeed(world: int) -> None:
    # Each tied checkpoint at its own stage, and the ZeRO-3 ones at stages 1 and 2, the
    # ZeRO-1 one at 3.
    runs: list[tuple[str, str, int | None]] = [(c, str(FIXTURES / c), None) for c in TIED]
    for case, stages in [
        ("resume_tied_stage3", (1, 2)),
        ("resume_tied_stage1", (3,)),
        ("resume_tied_frozen_stage3", (1,)),
    ]:
        runs.extend((case, str(FIXTURES / case), stage) for stage in stages)
    run_ranks(_resume_all, world, runs)


def _several_optimizers() -> None:
    # Each parameter's Adam state (and the step) in the optimizer that owns it, before
    # any step; then DeepSpeed's continuation (the hyperparameters of both optimizers
    # taken from the checkpoint's param group of their parameters).
    _loaded_moments([("resume_tied_stage2", 2), ("resume_tied_stage3", 3)], several=True)
    for case, stage in [("resume_tied_stage2", None), ("resume_tied_frozen_stage3", 1)]:
        _resume(case, FIXTURES / case, stage, several=True)
    # An optimizer that keeps no Adam state, beside AdamW: named with its param group.
    mf = _fixture_module()
    model = mf.MODELS["tied"]()
    sgd, adamw = _optimizer(model, several=True)  # type: ignore[misc]
    sgd = torch.optim.SGD(sgd.param_groups[0]["params"], lr=0.1, momentum=0.9)
    model, opt = zs.initialize(model, [sgd, adamw], {"stage": 2})
    with pytest.raises(ValueError, match=r"Adam state.*SGD \(param group 0's optimizer\)"):
        zs.load_checkpoint(model, opt, FIXTURES / "resume_tied_stage2")


def test_several_optimizers_resume_matches_deepspeed() -> None:
    """A DeepSpeed checkpoint of one AdamW into two (the blocks' matrices in one, the rest
    in the other), at stages 1-3 on 2 ranks: DeepSpeed's moments and continuation."""
    run_ranks(_several_optimizers, 2)


def _muon() -> None:
    # DeepSpeed Muon's momentum (each rank's whole matrices, end to end) and its Adam's
    # moments, by name, before any step, at every stage; then DeepSpeed's continuation.
    _loaded_moments([(MUON, stage) for stage in (1, 2, 3)])
    _resume(MUON, FIXTURES / MUON, None)
    # One AdamW for every parameter: its param groups mix Muon's and Adam's parameters.
    mf = _fixture_module()
    model = mf.MODELS["tied_even"]()
    model, opt = zs.initialize(model, _optimizer(model), {"stage": 2})
    with pytest.raises(ModelMismatchError, match=r"param group 0 .* Muon stepped"):
        zs.load_checkpoint(model, opt, FIXTURES / MUON)
    # The Muon parameters given AdamW: named with their optimizer.
    model = mf.MODELS["tied_even"]()
    model, opt = zs.initialize(model, _optimizer(model, several=True), {"stage": 2})
    with pytest.raises(ValueError, match=r"Muon's momentum .* AdamW \(param group 0's"):
        zs.load_checkpoint(model, opt, FIXTURES / MUON)


def test_muon_resume_matches_deepspeed() -> None:
    """A checkpoint of DeepSpeed's own Muon (ZeRO-2, world 2) into torch's Muon and AdamW
    on 2 ranks: its momentum and moments, and its continuation."""
    run_ranks(_muon, 2)


@pytest.mark.parametrize("world", [2, 3])
def test_resume_matches_deepspeed(world: int) -> None:
    # One spawn per world size runs every case (stages 1, 2, 3 in fp32, ZeRO-2 fp16) at
    # DeepSpeed's stage, and a ZeRO-3 checkpoint at our stage 1 and a ZeRO-1 one at 3.
    runs = [(case, str(FIXTURES / case), None) for case in CASES]
    runs += [("resume_stage3", str(FIXTURES / "resume_stage3"), 1)]
    runs += [("resume_stage1", str(FIXTURES / "resume_stage1"), 3)]
    run_ranks(_resume_all, world, runs)


@pytest.mark.parametrize("world", [1, 2])
def test_resume_of_a_compiled_models_checkpoint(world: int) -> None:
    # DeepSpeed trained TiedLM compiled whole before deepspeed.initialize: every name in
    # its files starts `_orig_mod.`. It resumes into the model compiled alike at its own
    # stage, and into the plain model at stages 2 and 3.
    run_ranks(_resume_compiled, world, [(2, "compiled"), (2, "tied"), (3, "tied")])


def test_convert_then_resume_matches_deepspeed(tmp_path: Path) -> None:
    # `zeroshard-ckpt convert` (here into 3 rank files, DeepSpeed's were 2), then a
    # resume from the zeroshard checkpoint at world 3, without reading DeepSpeed's files.
    runs: list[tuple[str, str, int | None]] = []
    for case in CASES:
        assert (
            main(["convert", str(FIXTURES / case), str(tmp_path / case), "--world-size", "3"]) == 0
        )
        runs.append((case, str(tmp_path / case), None))
    run_ranks(_resume_all, 3, runs)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _refusals(root: str) -> None:
    mf = _fixture_module()
    # An optimizer whose state is not Adam's: a clear error naming both.
    model = mf.TinyLM()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = zs.initialize(model, sgd, {"stage": 2})
    with pytest.raises(ValueError, match=r"Adam state.*SGD"):
        zs.load_checkpoint(model, opt, FIXTURES / "resume_stage2")
    # Param groups built differently from the DeepSpeed run's.
    model = mf.TinyLM()
    model, opt = zs.initialize(model, torch.optim.AdamW(model.parameters()), {"stage": 2})
    with pytest.raises(ModelMismatchError, match="param group 0"):
        zs.load_checkpoint(model, opt, FIXTURES / "resume_stage2")
    # A scheduler's state is named as not carried over; hyperparameter changes are logged.
    records = _Records()
    logging.getLogger("zeroshard.engine").addHandler(records)
    logging.getLogger("zeroshard.engine").setLevel(logging.INFO)
    model, opt, _ = _build("resume_stage1")
    assert zs.load_checkpoint(model, opt, Path(root) / "with_scheduler") == 2
    text = "\n".join(records.messages)
    assert "lr_scheduler" in text and "not carried over" in text, text
    assert "lr 0.001 -> 0.01" in text, text


def test_refusals_and_messages(tmp_path: Path) -> None:
    import shutil

    root = tmp_path / "with_scheduler"
    shutil.copytree(FIXTURES / "resume_stage1", root)
    states = root / "global_step2" / "mp_rank_00_model_states.pt"
    model_states = torch.load(states, weights_only=False)
    model_states["lr_scheduler"] = {"last_epoch": 2, "base_lrs": [0.01, 0.01]}
    torch.save(model_states, states)
    run_ranks(_refusals, 1, str(tmp_path))
