"""The composition table of docs/config.md holds: every pair of features it lists is tried.

The table (`## Composition`) has one row per pair of features: "works (`test`)", where
`test` is a test that trains the pair against a reference (test_composition_parity.py's,
built on `build` here, where neither feature's own tests do; or this one, where only a
step is taken), or "refused: why". Here, on 2 gloo ranks in one spawned job, every pair
the parity test does not train is built the way a user would (`FEATURES`: each feature
a small change to a `Recipe`), initialized on a small model (DeepSpeed's
`resume_tied_even_stage2` fixture model, so its checkpoint loads; with groups of their own,
the MoE model whose DeepSpeed checkpoint `deepspeed_moe_checkpoint` writes) and stepped once
(`realize`, with `build`): a "works" pair that raises fails the test, and so
does a "refused" pair that does not raise a ValueError (a refusal names its reason). A
feature added to `FEATURES` without its rows in the table fails
`test_table_lists_every_pair`.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "config.md"
FIXTURE = ROOT / "tests" / "ckpt" / "fixtures" / "deepspeed" / "resume_tied_even_stage2"
# The same model trained by DeepSpeed's own Muon (on the blocks' matrices, its Adam on the
# rest): what a Muon recipe resumes.
MUON_FIXTURE = FIXTURE.parent / "resume_muon_stage2"
SECTION = "## Composition"
# The test that trains a pair against its reference, where no feature's own test does:
# its rows are tried there, not here.
PARITY_TEST = "tests/integration/test_composition_parity.py::test_pairs_match_their_reference"
ALL_STAGES = frozenset({1, 2, 3})


@dataclass(frozen=True)
class Recipe:
    """What a user's training script chooses; `realize` builds and steps it."""

    config: dict[str, Any] = field(default_factory=dict)
    stage: int | None = None  # chosen by a stage feature
    stages: frozenset[int] = ALL_STAGES  # where the features chosen so far exist
    # "adamw", "muon" (Muon + AdamW), "several" (SGD + AdamW; Adam + AdamW, both fused,
    # where the step is delayed or a DeepSpeed checkpoint loaded)
    optimizers: str = "adamw"
    tensor_parallel: bool = False
    hybrid: bool = False
    own_groups: bool = False
    meta: bool = False
    float8: bool = False
    compiled: bool = False
    step_in_backward: bool = False
    deepspeed: bool = False
    snapshots: bool = False
    journal: bool = False  # snapshots with their gradient journal (full_every > 1)

    def with_config(self, **entries: Any) -> Recipe:
        return dataclasses.replace(self, config={**self.config, **entries})

    def at(self, stages: set[int]) -> Recipe:
        return dataclasses.replace(self, stages=self.stages & stages)


def _stage(k: int) -> Callable[[Recipe], Recipe]:
    return lambda r: dataclasses.replace(r, stage=k)


def _offload(r: Recipe) -> Recipe:
    return r.with_config(offload_optimizer=True)


# The features of the table, by the name its rows use: each a change to a recipe.
FEATURES: dict[str, Callable[[Recipe], Recipe]] = {
    "stage 1": _stage(1),
    "stage 2": _stage(2),
    "stage 3": _stage(3),
    "offload_optimizer": _offload,
    "offload_params": lambda r: _offload(r).with_config(offload_params=True).at({3}),
    "bf16 masters": lambda r: r.with_config(compute_dtype="bf16", master_dtype="bf16"),
    # A first loss scale no step of the test overflows at (as the fp16 tests choose): a
    # skipped step would leave the parity test's reference behind.
    "fp16": lambda r: r.with_config(compute_dtype="fp16", initial_loss_scale=1024.0),
    "zeroshard.compile": lambda r: dataclasses.replace(r, compiled=True).at({3}),
    "fp8 gather": lambda r: dataclasses.replace(r, float8=True).at({3}),
    "Muon": lambda r: dataclasses.replace(r, optimizers="muon"),
    "several optimizers": lambda r: dataclasses.replace(r, optimizers="several"),
    "tensor parallelism": lambda r: dataclasses.replace(r, tensor_parallel=True),
    "hybrid sharding": lambda r: dataclasses.replace(r, hybrid=True),
    "own process groups": lambda r: dataclasses.replace(r, own_groups=True),
    "meta-device init": lambda r: dataclasses.replace(r, meta=True).at({3}),
    "step_in_backward": lambda r: dataclasses.replace(_offload(r), step_in_backward=True).at(
        {2, 3}
    ),
    "delay_param_update": lambda r: (
        _offload(r).with_config(offload_delay_param_update=True).at({1, 2})
    ),
    "DeepSpeed checkpoints": lambda r: dataclasses.replace(r, deepspeed=True),
    "snapshots": lambda r: dataclasses.replace(r, snapshots=True),
    "gradient journal": lambda r: dataclasses.replace(r, snapshots=True, journal=True),
}


def _recipe(a: str, b: str) -> Recipe:
    r = FEATURES[b](FEATURES[a](Recipe()))
    # A stage the user chose; else the highest where both exist (else where either does:
    # the engine then names what it refuses).
    stage = r.stage or max(r.stages or {3})
    return dataclasses.replace(r, stage=stage)


# -- the table ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    a: str
    b: str
    works: bool
    text: str

    @property
    def tests(self) -> list[str]:
        """The tests it names (`path::name`)."""
        return re.findall(r"`([\w/.]+\.py::\w+)`", self.text)


def read_table() -> dict[frozenset[str], Cell]:
    """docs/config.md's composition rows, by pair."""
    text = DOC.read_text()
    assert SECTION in text, f"{DOC} has no {SECTION!r} section"
    body = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    cells: dict[frozenset[str], Cell] = {}
    for line in body.splitlines():
        parts = [p.strip() for p in line.strip().strip("|").split("|")]
        if len(parts) != 3 or parts[0] in ("feature", "") or set(parts[0]) <= {"-", ":"}:
            continue
        a, b, status = parts
        assert status.startswith(("works", "refused:")), f"{a} x {b}: {status!r}"
        pair = frozenset((a, b))
        assert pair not in cells, f"{a} x {b} is listed twice"
        cells[pair] = Cell(a, b, status.startswith("works"), status)
    return cells


def _pairs() -> list[tuple[str, str]]:
    # The gradient journal is a way of taking snapshots, not a feature beside them.
    apart = [{"stage 1", "stage 2", "stage 3"}, {"snapshots", "gradient journal"}]
    return [(a, b) for a, b in combinations(FEATURES, 2) if not any({a, b} <= x for x in apart)]


def test_table_lists_every_pair() -> None:
    """One row for every pair of features (stages are not paired with each other), and
    every test a row names exists."""
    cells = read_table()
    want = {frozenset(p) for p in _pairs()}
    missing = sorted(" x ".join(sorted(p)) for p in want - set(cells))
    extra = sorted(" x ".join(sorted(p)) for p in set(cells) - want)
    assert not missing and not extra, f"missing rows {missing}; unknown rows {extra}"
    for cell in cells.values():
        if cell.works:
            assert cell.tests, f"{cell.a} x {cell.b} works but names no test"
        for name in cell.tests:
            path, test = name.split("::")
            source = (ROOT / path).read_text()
            assert re.search(rf"^def {test}\(", source, re.M), f"{name} does not exist"


# -- trying a pair ----------------------------------------------------------------------------


def _model(r: Recipe, mesh: Any, float8_gather: bool = True) -> nn.Module:
    """DeepSpeed's fixture model (`tied_even`), its blocks in fp8 (gathered in fp8 where
    sharded) and split over tp as asked."""
    sys.path.insert(0, str(FIXTURE.parent))
    try:
        import make_fixtures
    finally:
        sys.path.remove(str(FIXTURE.parent))
    torch.manual_seed(0)
    with torch.device("meta" if r.meta else "cpu"):
        model: nn.Module = make_fixtures.MODELS["tied_even"]()
    if r.float8:
        from torchao.float8 import convert_to_float8_training

        from tests.engine._float8 import float8_config

        config = float8_config("tensorwise", float8_gather, "cpu")
        convert_to_float8_training(
            model, config=config, module_filter_fn=lambda m, fqn: fqn.startswith("blocks")
        )
    if mesh is not None:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        plan: dict[str, Any] = {}
        for i in range(3):
            plan[f"blocks.{i}.up"] = ColwiseParallel()
            plan[f"blocks.{i}.down"] = RowwiseParallel()
        parallelize_module(model, mesh["tp"], plan)
    return model


def _optimizers(r: Recipe, model: nn.Module) -> list[torch.optim.Optimizer]:
    """AdamW (fused: what the delayed step takes) in DeepSpeed's run's two param groups;
    Muon or SGD on the blocks' matrices beside it."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    matrices = [p for n, p in named if n.startswith("blocks") and p.dim() == 2]
    rest = [
        (n, p) for n, p in named if r.optimizers == "adamw" or not any(p is m for m in matrices)
    ]
    groups = [
        {"params": [p for n, p in rest if "norm" not in n], "weight_decay": 0.1},
        {"params": [p for n, p in rest if "norm" in n], "weight_decay": 0.0},
    ]
    adamw = torch.optim.AdamW(groups, lr=1e-3, fused=True)
    if r.optimizers == "muon":
        return [torch.optim.Muon(matrices, lr=0.02), adamw]
    if r.optimizers == "several" and ("offload_delay_param_update" in r.config or r.deepspeed):
        # The delayed step snapshots fused Adam/AdamW only, and a DeepSpeed checkpoint
        # holds Adam's state: one optimizer or several.
        return [torch.optim.Adam(matrices, lr=1e-3, fused=True), adamw]
    if r.optimizers == "several":
        return [torch.optim.SGD(matrices, lr=0.1, momentum=0.9), adamw]
    return [adamw]


@dataclass
class Built:
    """A recipe initialized: the engine's model and optimizer, and its training step."""

    model: nn.Module
    opt: Any
    runner: Any  # the model, or zeroshard.compile's
    train: Callable[[torch.Tensor], torch.Tensor]  # one step on these tokens; its loss
    step: Callable[[], torch.Tensor]  # one step on this rank's batch; its loss


def fill(name: str, p: torch.Tensor) -> None:
    """The meta-device recipe's `param_init` value of parameter `name`: its name and
    index alone decide it (so a plain model can be given the same)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    salt = sum(map(ord, name)) % 97
    values = torch.arange(p.numel(), dtype=torch.float32)
    whole = torch.sin(values * 0.37 + salt).reshape(p.shape) * 0.3
    if isinstance(p, DTensor):  # each rank its piece of the whole value, no collective
        whole = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)
    p.copy_(whole)


def _param_init(model: nn.Module) -> Callable[[nn.Module], None]:
    """`fill` each parameter a unit's module owns, under its first name (a tied one has
    two; named by module, as the engine may replace a parameter, the fp8 gather's)."""
    first = {id(p): n for n, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
    alias = {n: first[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
    prefixes = {id(m): f"{n}." if n else "" for n, m in model.named_modules()}

    @torch.no_grad()
    def init(module: nn.Module) -> None:
        for name, p in module.named_parameters(recurse=False):
            full = prefixes[id(module)] + name
            fill(alias[full], p)

    return init


def _build_moe(r: Recipe, checkpoint: str) -> Built:
    """Groups of their own from a DeepSpeed checkpoint: experts, which only DeepSpeed's MoE
    checkpoints hold (one value per expert-parallel rank): DeepSpeed's MoE model
    (tests/engine/_ds_moe.py) with its experts on their expert data-parallel groups,
    loading the one DeepSpeed wrote."""
    import zeroshard.engine as zs
    from tests.engine import _ds_moe as moe
    from zeroshard.comm import Group

    moe.deepspeed_module()
    model = moe.MoELM()
    groups = {moe.EXPERTS_PATH: Group(moe.expert_data_group(model))}
    config = {"stage": r.stage, "min_unit_params": 1, "persistence_threshold": 0, **r.config}
    opt = torch.optim.AdamW(moe.param_groups(model), lr=1e-3)
    # DeepSpeed divides the experts' gradients by the whole data-parallel world.
    world = dist.get_world_size()
    model, opt = zs.initialize(
        model, opt, config, process_groups=groups, gradient_divide_factor=world
    )
    zs.load_checkpoint(model, opt, checkpoint)

    def train(tokens: torch.Tensor) -> torch.Tensor:
        loss = moe.loss_fn(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    tokens = moe.rows(moe.batches()[moe.STEPS])
    return Built(model, opt, model, train, lambda: train(tokens))


def build(r: Recipe, own: Any, moe_checkpoint: str | None = None) -> Built:
    """Build the recipe as a user would and initialize it (a DeepSpeed checkpoint loaded:
    with groups of their own, `moe_checkpoint`, DeepSpeed's MoE one: `_build_moe`);
    whatever the engine refuses raises. Tensor parallelism splits over 2 ranks, the data
    over the others."""
    from torch.distributed.device_mesh import init_device_mesh

    import zeroshard.compile as zc
    import zeroshard.engine as zs

    if r.own_groups and r.deepspeed and moe_checkpoint is not None:
        return _build_moe(r, moe_checkpoint)

    mesh = None
    if r.tensor_parallel:
        dp = dist.get_world_size() // 2
        shape, names = ((dp, 2), ("dp", "tp"))
        if r.hybrid:
            shape, names = ((dp, 1, 2), ("dp_replicate", "dp_shard", "tp"))
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    config = {"stage": r.stage, "min_unit_params": 1, "persistence_threshold": 0, **r.config}
    if r.hybrid and not r.tensor_parallel:
        config["shard_group_size"] = 1
    model = _model(r, mesh)
    kwargs: dict[str, Any] = {}
    if mesh is not None:
        kwargs["device_mesh"] = mesh
    if r.own_groups:
        kwargs["process_groups"] = {"blocks.1": own}
    if r.meta:
        kwargs["param_init"] = _param_init(model)
    opts = _optimizers(r, model)
    model, opt = zs.initialize(model, opts if len(opts) > 1 else opts[0], config, **kwargs)
    if r.deepspeed:
        zs.load_checkpoint(model, opt, MUON_FIXTURE if r.optimizers == "muon" else FIXTURE)
    runner: Any = zc.compile(model, backend="aot_eager") if r.compiled else model
    tokens = torch.randint(0, 37, (2, 5), generator=torch.Generator().manual_seed(dist.get_rank()))

    def train(tokens: torch.Tensor) -> torch.Tensor:
        out = runner(tokens).float().flatten(0, 1)
        loss = torch.nn.functional.cross_entropy(out, tokens.flatten())
        if r.step_in_backward:
            with opt.step_in_backward():
                loss.backward()
        else:
            loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return Built(model, opt, runner, train, lambda: train(tokens))


def realize(r: Recipe, own: Any, folder: Path, moe_checkpoint: str) -> None:
    """Build the recipe and take one step (with snapshots: `_round_trip` in `folder`);
    whatever the engine refuses raises."""
    built = build(r, own, moe_checkpoint)
    if r.snapshots:
        _round_trip(built, folder, r.journal)
    else:
        built.step()
    if r.compiled and built.runner.eager:
        raise RuntimeError("zeroshard.compile fell back to the eager model")


def state_of(model: nn.Module, opt: Any) -> dict[str, Any]:
    """What training goes on from, as a user reads it: the full weights (the masters) and
    every optimizer's state dict."""
    import zeroshard.engine as zs

    opt.settle()  # a delayed step in flight is part of the state
    return {"weights": zs.full_state_dict(model), "optimizer": opt.state_dict()}


def equal(a: Any, b: Any) -> bool:
    """Bit for bit, through nested dicts and lists."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _round_trip(built: Built, folder: Path, journal: bool = False) -> None:
    """A snapshot after one step (with the `journal`, a full snapshot and then an entry of
    the second step), restored after the next: RuntimeError unless the state restored is
    the one snapshotted (the entry replayed) and the step after it repeats the
    uninterrupted one (its loss and the state it leaves), bit for bit."""
    import copy

    import zeroshard.engine as zs
    from zeroshard.engine.recovery._store import ENTRY

    model, opt, step = built.model, built.opt, built.step
    taken = 2 if journal else 1
    snaps = zs.Snapshots(model, opt, every=1, full_every=taken, root=folder / "shm")
    try:
        for s in range(taken):
            step()
            snaps.take(s + 1)
        snaps.wait()
        if journal and ENTRY not in {h.kind for h in snaps.store.held() if h.step == 2}:
            raise RuntimeError("snapshots: step 2 was snapshotted in full, not journaled")
        saved = copy.deepcopy(state_of(model, opt))
        loss = step()
        after = copy.deepcopy(state_of(model, opt))
        if snaps.resume(folder / "ckpt") != taken or snaps.last_resume.source != "memory":
            raise RuntimeError(
                f"snapshots: resumed {snaps.last_resume}, not step {taken} from memory"
            )
        if not equal(state_of(model, opt), saved):
            raise RuntimeError("snapshots: the state restored is not the state snapshotted")
        again = step()
        if not (equal(again, loss) and equal(state_of(model, opt), after)):
            raise RuntimeError("snapshots: the step after the restore differs from the first run's")
    finally:
        snaps.close()


def _try(pairs: list[tuple[str, str]], out: str, moe_checkpoint: str) -> None:
    """Each pair on this rank: '' where it ran, else the error, written by rank 0."""
    import json
    import traceback

    from zeroshard.comm import Group

    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    own = Group(singles[dist.get_rank()])
    results = {}
    for i, (a, b) in enumerate(pairs):
        try:
            realize(_recipe(a, b), own, Path(out).parent / f"pair{i}", moe_checkpoint)
            results[f"{a} x {b}"] = ""
        except Exception as e:
            kind = "ValueError" if isinstance(e, ValueError) else "other"
            results[f"{a} x {b}"] = f"{kind}: {type(e).__name__}: {e}".splitlines()[0]
            if kind == "other":
                results[f"{a} x {b}"] += "\n" + traceback.format_exc()
        # A rank whose pair failed alone left a collective the other never joins: realign.
        dist.barrier()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results, indent=1))


def test_table_holds(tmp_path: Path, deepspeed_moe_checkpoint: Path) -> None:
    """Every pair of the table, tried on 2 ranks: "works" ones run, "refused" ones raise a
    ValueError."""
    import json

    from tests._dist import run_ranks

    cells = read_table()
    pairs = [p for p in _pairs() if PARITY_TEST not in cells[frozenset(p)].tests]
    out = tmp_path / "results.json"
    run_ranks(_try, 2, pairs, str(out), str(deepspeed_moe_checkpoint), timeout_s=900)
    results = json.loads(out.read_text())
    wrong = []
    for a, b in pairs:
        cell, error = cells[frozenset((a, b))], results[f"{a} x {b}"]
        if cell.works and error:
            wrong.append(f"{a} x {b} is listed as working but raised {error}")
        elif not cell.works and not error.startswith("ValueError"):
            what = "ran" if not error else f"raised no ValueError but {error}"
            wrong.append(f"{a} x {b} is listed as refused but {what}")
    assert not wrong, "\n".join(wrong)


if __name__ == "__main__":
    # Discovery: every pair's outcome, to write the table from (python -m ...).
    import json
    import tempfile

    from tests._dist import run_ranks
    from tests.engine._ds_moe import write_checkpoint

    with tempfile.TemporaryDirectory() as d:
        run_ranks(write_checkpoint, 2, f"{d}/moe", timeout_s=300)
        run_ranks(_try, 2, _pairs(), f"{d}/r.json", f"{d}/moe", timeout_s=1800)
        for pair, error in json.loads(Path(f"{d}/r.json").read_text()).items():
            print(f"{pair}: {error or 'works'}")
