"""The composition table's pairs trained against a reference nobody here wrote, each with
a checkpoint saved and resumed in the pair.

Every row of docs/config.md's `## Composition` that names `test_pairs_match_their_reference`
is built as test_composition.py builds it (`build`: the recipe a user writes, on DeepSpeed's
`tied_even` fixture model, 2 gloo ranks, all pairs in one spawned job) and trained
`STEPS` steps, each data-parallel rank on its part of a global batch. The reference is
plain torch in this process, one replica of the model per data-parallel rank (each
forward on its rank's rows, the gradients averaged: DDP's arithmetic, so torchao's fp8
activation scales are per rank as under DDP), composed from each feature's own reference
rule (`Reference`, in _composition_reference.py):

- bf16 masters: the replicas' parameters in bf16, the same optimizers (test_bf16_masters);
- fp16: the replicas compute in fp16 (the loss scaled by the recipe's scale) into fp32
  masters, as torch's mixed precision does; no step may be skipped for overflow. fp32
  replicas alone would do at fp16's tolerance, but not beside fp8: torchao's fp8 casts
  of fp16 values round otherwise than of fp32 ones (measured on plain torch + torchao:
  12.7% of the update apart, against 1.9% without fp8; the engine is 4e-5 from these);
- fp8 gather: torchao's fp8 linears in the replicas, gathering nothing (test_float8:
  its reference is torch DDP + torchao, which `replicas_are_ddp` holds the replicas to
  on the same ranks first);
- meta-device init: the replicas start from the `param_init` the recipe passes (`fill`);
- own process groups: the module on a group of its own keeps each rank's gradient, the
  rest the average (test_expert_groups); each rank compares its own replica;
- delay_param_update: forward computes with the weights one step behind the masters
  (test_offload_delayed's lag by hand);
- DeepSpeed checkpoints: the replicas start from what DeepSpeed's fixture holds (its
  module weights, its Adam moments and step, its optimizer's hyperparameters):
  `test_deepspeed_start_continues_as_deepspeed` checks that start continues on
  DeepSpeed's batches to DeepSpeed's own losses and weights;
- tensor parallelism: the unsplit model, data-parallel over the mesh's dp dim alone;
- offload, step_in_backward, zeroshard.compile, hybrid sharding, several optimizers and
  Muon change nothing in the reference (their tests hold them to fp32's tolerance).

Checked: every step's global mean loss and every weight (`zs.full_state_dict`) at the
loosest of the two features' tolerances (`TOLERANCES`). Then a checkpoint saved after
step 2 is loaded by the recipe built afresh, whose step 3 must repeat the uninterrupted
run's loss, weights and optimizer state bit for bit (fp8 too: torchao's tensorwise
scales are taken from each step's values, no amax history to restore); with
delay_param_update the resumed run has no lag on its first step (the loaded weights are
published at once), so its step 3 is checked instead against the reference resumed
alike, at the tolerance.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from tests.integration._composition_reference import Reference, rank_loss
from tests.integration.test_composition import (
    FEATURES,
    FIXTURE,
    PARITY_TEST,
    Recipe,
    _model,
    _optimizers,
    _recipe,
    build,
    equal,
    read_table,
    state_of,
)

STEPS = 3
SAVED = 2  # the checkpoint is saved after this many steps
ROWS = 2  # rows (of 5 tokens) each data-parallel rank trains on a step


@dataclass(frozen=True)
class Tolerance:
    """How close a pair's run must be to its reference."""

    loss: tuple[float, float]  # rtol, atol of each step's global mean loss
    weights: tuple[float, float]  # rtol, atol of every weight after the steps
    # Where set, instead of `weights`: the whole update (final - initial, every trainable
    # tensor together) within this share of the reference's in norm.
    update: float | None = None

    def __or__(self, other: Tolerance) -> Tolerance:
        """The looser of the two, bound by bound."""
        updates = [u for u in (self.update, other.update) if u is not None]
        return Tolerance(
            (max(self.loss[0], other.loss[0]), max(self.loss[1], other.loss[1])),
            (max(self.weights[0], other.weights[0]), max(self.weights[1], other.weights[1])),
            max(updates) if updates else None,
        )


FP32 = Tolerance((1e-5, 1e-6), (1e-5, 1e-6))
# Each feature's own test's tolerance; the others' are fp32's (test_parity.py: the same
# arithmetic, the gradients summed in another order).
TOLERANCES = {
    # test_bf16_masters.py: the ranks' bf16 gradient sums round otherwise than one
    # process's, and bf16 rounding flips the sign of Adam's update on tiny gradients.
    "bf16 masters": Tolerance((2e-2, 1e-2), (0.0, 0.0), update=0.10),
    # test_whole_matrix.py / test_parity.py's low precision, against an fp32 reference.
    "fp16": Tolerance((2e-2, 1e-2), (0.0, 0.0), update=0.10),
    # test_float8.py: a gradient summed in another order can cross an fp8 rounding
    # boundary, and the elements it feeds then take a slightly different Adam update.
    "fp8 gather": Tolerance((1e-5, 0.0), (0.0, 2e-4)),
}


def tolerance(a: str, b: str) -> Tolerance:
    return TOLERANCES.get(a, FP32) | TOLERANCES.get(b, FP32)


def _dp(r: Recipe) -> tuple[int, int]:
    """The data-parallel size and this rank's index (`build` splits tp over 2 ranks)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    return (world // 2, rank // 2) if r.tensor_parallel else (world, rank)


def _batches(dp: int) -> torch.Tensor:
    """[STEPS, dp * ROWS, 5] token ids: each step's global batch, the same on every rank."""
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, 37, (STEPS, dp * ROWS, 5), generator=g)


# -- a pair -----------------------------------------------------------------------------------


@dataclass
class Run:
    """What the engine's run of a pair gave, and its resumed step."""

    losses: list[float]  # global means
    local: torch.Tensor  # this rank's loss of the step after the checkpoint
    state: dict[str, Any]  # after every step (weights and optimizer state)
    resumed_local: torch.Tensor
    resumed_loss: float  # its global mean
    resumed: dict[str, Any]
    skipped: int  # fp16 steps skipped for overflow


def _global(loss: torch.Tensor) -> float:
    total = loss.reshape(1).clone()
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def _engine_run(r: Recipe, own: Any, data: torch.Tensor, folder: Path) -> Run:
    """Train `r`, saving after step SAVED; then resume it afresh and take the next step."""
    import zeroshard.engine as zs

    dp, me = _dp(r)
    built = build(r, own)
    losses, local = [], torch.zeros(())
    for k in range(STEPS):
        if k == SAVED:
            zs.save_checkpoint(built.model, built.opt, folder, step=SAVED)
        local = built.train(data[k].chunk(dp)[me])
        losses.append(_global(local))
    if r.compiled and built.runner.eager:
        raise RuntimeError("zeroshard.compile fell back to the eager model")
    state = copy.deepcopy(state_of(built.model, built.opt))
    scaler = built.opt.scaler
    again = build(r, own)
    if zs.load_checkpoint(again.model, again.opt, folder) != SAVED:
        raise RuntimeError("the checkpoint did not load step 2")
    resumed_local = again.train(data[SAVED].chunk(dp)[me])
    resumed_loss = _global(resumed_local)
    resumed = copy.deepcopy(state_of(again.model, again.opt))
    skipped = 0 if scaler is None else scaler.skipped_steps
    return Run(losses, local, state, resumed_local, resumed_loss, resumed, skipped)


def _differences(
    tol: Tolerance,
    weights: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    initial: dict[str, torch.Tensor],
    frozen: set[str],
) -> list[str]:
    """Where the weights are not within `tol` of the reference's."""
    if weights.keys() != want.keys():
        return [f"weights named {sorted(weights)} against {sorted(want)}"]
    out = []
    if tol.update is not None:
        for name in frozen:
            if not torch.equal(weights[name], want[name].to(weights[name].dtype)):
                out.append(f"{name}: a frozen parameter moved")
        moved = [k for k in initial if k not in frozen]
        ours = torch.cat([(weights[k].float() - initial[k].float()).reshape(-1) for k in moved])
        theirs = torch.cat([(want[k].float() - initial[k].float()).reshape(-1) for k in moved])
        err = float((ours - theirs).norm() / theirs.norm())
        if not err < tol.update:
            out.append(f"the update differs from the reference's by {err:.1%}")
        return out
    rtol, atol = tol.weights
    for name, value in want.items():
        try:
            torch.testing.assert_close(weights[name], value, rtol=rtol, atol=atol)
        except AssertionError as e:
            out.append(f"{name}: {e}")
    return out


def _close(a: list[float], b: list[float], bounds: tuple[float, float]) -> bool:
    return torch.allclose(torch.tensor(a), torch.tensor(b), rtol=bounds[0], atol=bounds[1])


def check_pair(a: str, b: str, own: Any, folder: Path) -> list[str]:
    """Train the pair against its reference and resume it: what differs, on this rank."""
    r = _recipe(a, b)
    dp, me = _dp(r)
    data = _batches(dp)
    own_groups = r.own_groups
    delayed = bool(r.config.get("offload_delay_param_update"))
    ref = Reference.of(r, dp)
    initial = ref.weights(me)
    frozen = {n for n, p in ref.masters[me].named_parameters() if not p.requires_grad}
    ref_losses = [ref.step(batch, own_groups) for batch in data[:SAVED]]
    # The step after the checkpoint, resumed: a delayed run publishes the loaded weights.
    again = copy.deepcopy(ref)
    if delayed:
        again.publish()
    ref_losses.append(ref.step(data[SAVED], own_groups))
    resumed_loss = again.step(data[SAVED], own_groups)
    run = _engine_run(r, own, data, folder)

    tol = tolerance(a, b)
    wrong = []
    if run.skipped:
        wrong.append(f"{run.skipped} fp16 steps skipped for overflow: the reference took them")
    if not _close(run.losses, ref_losses, tol.loss):
        wrong.append(f"losses {run.losses} against the reference's {ref_losses}")
    wrong += _differences(tol, run.state["weights"], ref.weights(me), initial, frozen)
    if delayed:
        # No lag on the resumed run's first step: the reference resumed alike.
        if not _close([run.resumed_loss], [resumed_loss], tol.loss):
            wrong.append(f"resumed: loss {run.resumed_loss} against {resumed_loss}")
        resumed = run.resumed["weights"]
        wrong += [
            f"resumed: {d}" for d in _differences(tol, resumed, again.weights(me), initial, frozen)
        ]
    else:
        if not equal(run.resumed_local, run.local):
            wrong.append(f"resumed: loss {run.resumed_local} against {run.local}")
        if not equal(run.resumed, run.state):
            wrong.append("resumed: the weights or optimizer state differ from the first run's")
    return wrong


def replicas_are_ddp() -> list[str]:
    """The replicas of an fp8 recipe against torch DDP + torchao on these ranks (what
    test_float8.py takes as fp8's reference): where they differ, at fp8's tolerance."""
    r = dataclasses.replace(Recipe(), float8=True)
    world, rank = dist.get_world_size(), dist.get_rank()
    data = _batches(world)
    replicas = Reference.of(r, world)
    want = [replicas.step(batch) for batch in data]
    model = _model(r, None, float8_gather=False)
    ddp = nn.parallel.DistributedDataParallel(model)
    (opt,) = _optimizers(r, model)
    losses = []
    for batch in data:
        loss = rank_loss(ddp, batch.chunk(world)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_global(loss.detach()))
    tol = TOLERANCES["fp8 gather"]
    wrong = [] if _close(losses, want, tol.loss) else [f"losses {losses} against DDP's {want}"]
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return wrong + _differences(tol, replicas.weights(rank), weights, {}, set())


def _check_all(pairs: list[tuple[str, str]], out: str) -> None:
    """The replicas against DDP, then each pair, on these ranks: what differs on any
    rank, written by rank 0."""
    from zeroshard.comm import Group

    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    own = Group(singles[dist.get_rank()])
    results = {}
    checks = [("the reference's replicas", "torch DDP", replicas_are_ddp)]
    for i, (a, b) in enumerate(pairs):
        folder = Path(out).parent / f"pair{i}"
        checks.append((a, b, lambda a=a, b=b, folder=folder: check_pair(a, b, own, folder)))
    for a, b, check in checks:
        # Named on stderr first: a rank that dies in native code (a heap corruption was
        # seen once in CI, in a compiled pair) shows which pair it was in.
        print(f"rank {dist.get_rank()}: {a} x {b}", file=sys.stderr, flush=True)
        try:
            wrong = check()
        except Exception:
            wrong = [traceback.format_exc()]
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, wrong)
        results[f"{a} x {b}"] = [f"rank {k}: {w}" for k, ws in enumerate(everyone) for w in ws]
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results, indent=1))


# The features whose reference rule `Reference` composes (snapshots and their journal are
# test_composition's round trip's; the stages change nothing in a reference).
COMPOSED = set(FEATURES) - {"snapshots", "gradient journal"}


def test_pairs_match_their_reference(tmp_path: Path) -> None:
    """Every pair whose row names this test, on 2 ranks against its reference, resumed
    from a checkpoint in the pair (see the module docstring); first, the reference's
    replicas against torch DDP, with torchao's fp8."""
    from tests._dist import run_ranks

    pairs = sorted((c.a, c.b) for c in read_table().values() if PARITY_TEST in c.tests)
    assert pairs, f"no row of the table names {PARITY_TEST}"
    beyond = [f"{a} x {b}" for a, b in pairs if not {a, b} <= COMPOSED]
    assert not beyond, f"rows name {PARITY_TEST} for pairs it has no reference for: {beyond}"
    out = tmp_path / "results.json"
    run_ranks(_check_all, 2, pairs, str(out), timeout_s=600)
    wrong = {pair: w for pair, w in json.loads(out.read_text()).items() if w}
    assert not wrong, "\n".join(f"{pair}:\n  " + "\n  ".join(w) for pair, w in wrong.items())


def test_deepspeed_start_continues_as_deepspeed() -> None:
    """The DeepSpeed rule's start (the fixture's weights, moments, step and
    hyperparameters), trained on DeepSpeed's batches in its 2 ranks' rows with its
    clipping, gives DeepSpeed's own continuation: its losses and weights."""
    ref = json.loads((FIXTURE / "resume.json").read_text())
    replicas = Reference.of(dataclasses.replace(Recipe(), deepspeed=True), ref["world_size"])
    losses = [replicas.step(batch, clip=ref["clip"]) for batch in torch.tensor(ref["batches"])]
    torch.testing.assert_close(losses, ref["losses"], rtol=1e-6, atol=0)
    weights = replicas.weights(0)
    for name, value in load_file(FIXTURE / "continued.safetensors").items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-6, msg=name)
