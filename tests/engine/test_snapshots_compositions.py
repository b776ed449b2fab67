"""Snapshots (zeroshard.engine.recovery) in combinations of features, each built by the
composition table's own recipes (tests/integration/test_composition.py): a snapshot at
step 2, the run going on to step 4, rank 1's own copy lost; `resume` puts back step 2
from the replica its peer keeps, bit for bit, and the steps after it repeat the
uninterrupted run's (losses and the state they leave, bit for bit). Under
delay_param_update those losses are computed one step behind the masters, so they repeat
only where the restore gave the lag back. One spawned job per case list: 2 ranks, 4 for
tensor parallelism (2 x 2)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import zeroshard.engine as zs
from tests._dist import run_ranks
from tests.integration.test_composition import (
    FEATURES,
    Built,
    Recipe,
    _model,
    _optimizers,
    build,
    equal,
    state_of,
)
from zeroshard.ckpt import CheckpointError, buffer_key
from zeroshard.comm import Group
from zeroshard.engine.recovery._contents import check_snapshot, rank_contents
from zeroshard.engine.recovery._file import Snapshot
from zeroshard.engine.recovery._store import OWN
from zeroshard.engine.state._checkpoint_layout import file_group

# Each a user's recipe of several features at once; the pairs are the table's.
TWO_RANKS = [
    ("stage 3", "offload_params", "bf16 masters", "step_in_backward"),
    ("stage 2", "fp16", "Muon", "offload_optimizer"),
    ("zeroshard.compile", "fp8 gather", "meta-device init"),
    ("stage 1", "several optimizers", "DeepSpeed checkpoints", "hybrid sharding"),
    ("stage 3", "own process groups", "Muon"),
]
FOUR_RANKS = [
    ("stage 2", "tensor parallelism", "Muon", "offload_optimizer"),
    ("zeroshard.compile", "tensor parallelism", "hybrid sharding", "DeepSpeed checkpoints"),
]


def recipe(features: tuple[str, ...]) -> Recipe:
    """The features applied in order, at the stage chosen or else the highest where all
    exist."""
    r = Recipe()
    for name in features:
        r = FEATURES[name](r)
    return dataclasses.replace(r, stage=r.stage or max(r.stages))


def _restore_from_replica(features: tuple[str, ...], folder: Path, own: Group) -> None:
    built = build(recipe(features), own)
    model, opt, step = built.model, built.opt, built.step
    snaps = zs.Snapshots(model, opt, every=2, root=folder / "shm")
    try:
        # `take` gathers the metadata's objects over gloo, numbered as the file group is.
        files, objects = file_group(zs.engine_state(model)), snaps._objects
        assert objects.backend == "gloo", features
        assert [objects.global_rank(r) for r in range(objects.size)] == [
            files.global_rank(r) for r in range(files.size)
        ], features
        losses, states = [], []
        for s in range(4):
            losses.append(step())
            states.append(copy.deepcopy(state_of(model, opt)))
            if s < 2:
                snaps.take(s + 1)
        snaps.wait()
        if dist.get_rank() == 1:
            snaps.store.path(2, 1, dist.get_world_size(), OWN).unlink()
        dist.barrier()
        resumes_and_repeats(features, built, snaps, folder, 2, losses, states)
    finally:
        snaps.close()


def resumes_and_repeats(
    features: tuple[str, ...],
    built: Built,
    snaps: zs.Snapshots,
    folder: Path,
    at: int,
    losses: list[Any],
    states: list[Any],
) -> None:
    """`snaps.resume` restores step `at` from memory (the state the uninterrupted run had
    there), and the next two steps repeat that run's losses and states; a compiled runner
    stayed compiled."""
    assert snaps.resume(folder / "ckpt") == at, features
    assert snaps.last_resume is not None and snaps.last_resume.source == "memory"
    assert equal(state_of(built.model, built.opt), states[at - 1]), (
        f"{features}: not the state of step {at}"
    )
    for s in (at, at + 1):
        loss = built.step()
        assert equal(loss, losses[s]), f"{features}: step {s + 1}'s loss differs"
        assert equal(state_of(built.model, built.opt), states[s]), (
            f"{features}: step {s + 1} differs"
        )
    if built.runner is not built.model:
        assert not built.runner.eager, f"{features}: compile fell back to eager"


def _cases(cases: list[tuple[str, ...]], folder: str) -> None:
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    own = Group(singles[dist.get_rank()])
    for i, features in enumerate(cases):
        _restore_from_replica(features, Path(folder) / str(i), own)


def test_snapshots_restore_in_combinations(tmp_path: Path) -> None:
    """Two ranks, each its own node: offloaded parameters with bf16 masters stepping in
    backward; fp16 with Muon offloaded; compiled with the fp8 gather from the meta device;
    stage 1 with Adam + AdamW from DeepSpeed's checkpoint, hybrid; Muon with a block on a
    group of its own."""
    run_ranks(_cases, 2, TWO_RANKS, str(tmp_path), timeout_s=600)


def test_snapshots_restore_under_tensor_parallelism(tmp_path: Path) -> None:
    """Four ranks, 2 (data) x 2 (tensor): Muon offloaded, each matrix joined whole over tp;
    compiled on a 3-D mesh from DeepSpeed's checkpoint."""
    run_ranks(_cases, 4, FOUR_RANKS, str(tmp_path), timeout_s=600)


# Under delay_param_update forward computes one step behind the masters: a restore brings
# that lag back too (the steps after it fail without: they would compute at the masters).
DELAYED = [
    ("stage 1", "delay_param_update", "several optimizers"),
    ("stage 2", "delay_param_update"),
    ("stage 2", "delay_param_update", "Muon"),
    ("stage 1", "delay_param_update", "bf16 masters"),
]


def _lagging_contents(features: tuple[str, ...], own: Group) -> None:
    """The planner's snapshot (`zs.estimate(...).snapshot`) is the rank's, to the byte:
    the tensors `take` writes less the module buffers and the optimizers' scalar step
    counts; the lagging parameters' shard (compute dtype) is what the lag adds. A lagging
    shard that does not fit the engine's group is refused by the restore's check."""
    r = recipe(features)
    built = build(r, own)
    built.step()
    built.opt.settle()  # as `take` does: the step in flight is the snapshot's
    assert built.opt.lagging
    state = zs.engine_state(built.model)
    meta, tensors, _ = rank_contents(built.model, state, 1, None, None)
    short = {k: t[1:] if k == "behind.group0" else t for k, t in tensors.items()}
    snap = Snapshot(1, dist.get_rank(), 2, meta, short, None)
    with pytest.raises(CheckpointError, match=r"one step behind .* flat group 0's"):
        check_snapshot(state, snap, "the snapshot", None, None)
    taken = sum(
        t.nbytes for k, t in tensors.items() if t.dim() and not k.startswith(buffer_key(""))
    )
    behind = sum(t.nbytes for k, t in tensors.items() if k.startswith("behind."))
    meta = _model(dataclasses.replace(r, meta=True), None)
    config = {"stage": r.stage, "min_unit_params": 1, "persistence_threshold": 0, **r.config}

    def planned(delayed: bool) -> int:
        cfg = {**config, "offload_delay_param_update": delayed}
        return zs.estimate(meta, cfg, 2, 2, 5, optimizer=_optimizers(r, meta)).snapshot

    assert planned(True) == taken, (features, planned(True), taken)
    assert behind > 0 and planned(True) - planned(False) == behind, features


def _delayed(folder: str) -> None:
    _cases(DELAYED, folder)
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    for features in DELAYED[:2]:
        _lagging_contents(features, Group(singles[dist.get_rank()]))


def test_snapshots_restore_the_delayed_update(tmp_path: Path) -> None:
    """delay_param_update: fused Adam + AdamW at stage 1; AdamW at stage 2; Muon beside
    the delayed AdamW (its matrices step at step(), published a step later too); bf16
    masters at stage 1. The planner prices the lagging parameters byte for byte."""
    run_ranks(_delayed, 2, str(tmp_path), timeout_s=600)
