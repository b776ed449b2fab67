"""Parameters on a data-parallel group of their own (experts under expert parallelism).

World 4 = 2 expert-parallel ranks x 2 expert replicas: ranks {0, 2} hold expert 0 and
ranks {1, 3} expert 1 (different values under the same name). The trunk and head are
sharded over all 4 ranks; each expert only over its own pair, and its gradients are
averaged over that pair, as DDP on that group would. The single-process reference holds
both experts, trains on the global batch, and scales each expert's gradient by
world / group size = 2 to follow that convention.

Checkpoints: each stage's world-4 model is saved (the expert groups' two instances, one
per pair of ranks, in the metadata), then loaded at world 2 where each expert is alone on
its rank (groups of 1): the loaded weights equal the saved ones exactly, and one more
step matches the reference continued from its own saved state (momentum included).
Consolidation writes one instance at a time, equal to that instance's full state dict.

Ranks built with weights of their own start from the first rank of each parameter's
replicas: the trunk from rank 0, each expert from the first rank of its pair.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks, subtests
from tests.engine._models import VOCAB, global_batches
from zeroshard.ckpt import CheckpointError, ModelMismatchError, consolidate
from zeroshard.ckpt._cli import main as cli_main
from zeroshard.comm import Group

D = 11


class Trunk(nn.Module):
    """A trunk (embedding, head) of seed 0 and an expert (an MLP of `hidden` x `d`) of
    seed 100 + `expert_seed`: each expert's values its own, the trunk's the same."""

    def __init__(self, expert_seed: int, d: int = D, hidden: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, d)
        self.head = nn.Linear(d, VOCAB)
        torch.manual_seed(100 + expert_seed)
        self.expert = nn.Sequential(nn.Linear(d, hidden * d), nn.GELU(), nn.Linear(hidden * d, d))

    def forward(self, tokens: torch.Tensor, expert: nn.Module | None = None) -> torch.Tensor:
        x = self.emb(tokens)
        return self.head(x + (expert or self.expert)(x))


def _loss(model: nn.Module, batch: torch.Tensor, expert: nn.Module | None = None) -> torch.Tensor:
    logits = model(batch[..., :-1], expert)
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch[..., 1:].reshape(-1))


def _reference() -> tuple[Trunk, list[nn.Module], torch.optim.Optimizer]:
    """One trunk, both experts, one optimizer over all of them."""
    ref = Trunk(0)
    experts = [copy.deepcopy(ref.expert), copy.deepcopy(Trunk(1).expert)]
    ref_params = [*ref.emb.parameters(), *ref.head.parameters()]
    ref_opt = torch.optim.SGD(
        [*ref_params, *experts[0].parameters(), *experts[1].parameters()], lr=0.1, momentum=0.9
    )
    return ref, experts, ref_opt


def _engine(stage: int, mine: int, group: Group) -> tuple[nn.Module, zs.ZeroOptimizer]:
    model = Trunk(mine)
    cfg = {"stage": stage, "reduce_bucket_bytes": 800}
    if stage == 3:
        cfg.update(unit_modules=["expert"], min_unit_params=1, persistence_threshold=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return zs.initialize(model, opt, cfg, process_groups={"expert": group})


def _train_both(
    model: nn.Module,
    zopt: zs.ZeroOptimizer,
    reference: tuple[Trunk, list[nn.Module], torch.optim.Optimizer],
    batches: torch.Tensor,
) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, experts, ref_opt = reference
    for step in range(batches.shape[0]):
        _loss(model, batches[step, 0, rank]).backward()
        zopt.step()
        zopt.zero_grad()
        loss = sum(_loss(ref, batches[step, 0, r], experts[r % 2]) for r in range(world))
        (loss / world).backward()
        for e in experts:
            for p in e.parameters():
                p.grad.mul_(2)  # averaged over its group (world / 2 ranks), not the world
        ref_opt.step()
        ref_opt.zero_grad()


def _matches_reference(model: nn.Module, ref: Trunk, expert: nn.Module) -> None:
    full = zs.full_state_dict(model)
    want = {**ref.state_dict(), **{f"expert.{k}": v for k, v in expert.state_dict().items()}}
    for name, value in want.items():
        torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _case(pairs: dict[int, Group], stage: int, root: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = rank % 2
    model, zopt = _engine(stage, mine, pairs[mine])
    ref, experts, ref_opt = reference = _reference()
    _train_both(model, zopt, reference, global_batches(3, 1, world, 2))
    _matches_reference(model, ref, experts[mine])
    zs.save_checkpoint(model, zopt, f"{root}/s{stage}", step=3)
    full = zs.full_state_dict(model)
    if rank < 2:  # ranks 0 and 1 hold instances 0 and 1 (the pairs in order of first rank)
        torch.save(full, f"{root}/s{stage}-instance{rank}.pt")
    if rank == 0:
        saved = {"ref": ref.state_dict(), "experts": [e.state_dict() for e in experts]}
        torch.save({**saved, "opt": ref_opt.state_dict()}, f"{root}/s{stage}-reference.pt")
    dist.barrier()


def _start_from_own_group(pairs: dict[int, Group]) -> None:
    """Every rank built with weights of its own: the trunk becomes rank 0's, each expert
    its pair's first rank's (rank 0 or 1: their experts differ, and stay so)."""
    rank = dist.get_rank()
    model = Trunk(100 + rank)  # an expert of its own on every rank
    with torch.no_grad():
        model.emb.weight.add_(rank)  # and a trunk of its own
    first = rank % 2  # the first rank of this rank's pair {first, first + 2}
    want = {
        **Trunk(0).state_dict(),
        **{f"expert.{k}": v for k, v in Trunk(100 + first).expert.state_dict().items()},
    }
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, _ = zs.initialize(model, opt, {"stage": 1}, process_groups={"expert": pairs[first]})
    for name, p in model.named_parameters():  # whole on every rank at stage 1
        assert torch.equal(p.detach(), want[name]), name


def _expert_groups(root: str) -> None:
    # Every rank creates both subgroups, in the same order.
    pairs = {e: Group(dist.new_group([e, e + 2])) for e in (0, 1)}
    run_each(subtests({"stage": [1, 2, 3]}), lambda stage: _case(pairs, stage, root))
    run_each([{}], lambda: _start_from_own_group(pairs))


@pytest.fixture(scope="module")
def world4_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Trained and saved on 4 ranks (each stage): checkpoints, each instance's full state
    dict, and the reference's state."""
    root = tmp_path_factory.mktemp("experts")
    run_ranks(_expert_groups, 4, str(root))
    return root


def test_expert_parameters_on_their_own_group(world4_checkpoints: Path) -> None:
    # The training parity is asserted on the ranks while the fixture is built.
    assert len(list(world4_checkpoints.glob("s*-instance*.pt"))) == 6


def _load_at_world2(root: str) -> None:
    rank = dist.get_rank()
    alone = {e: Group(dist.new_group([e])) for e in (0, 1)}
    for stage in (1, 2, 3):
        model, zopt = _engine(stage, rank, alone[rank])
        assert zs.load_checkpoint(model, zopt, f"{root}/s{stage}") == 3
        saved = torch.load(f"{root}/s{stage}-instance{rank}.pt")
        full = zs.full_state_dict(model)
        for name, value in saved.items():
            torch.testing.assert_close(full[name], value, rtol=0, atol=0, msg=name)
        ref, experts, ref_opt = reference = _reference()
        state = torch.load(f"{root}/s{stage}-reference.pt")
        ref.load_state_dict(state["ref"])
        for e, sd in zip(experts, state["experts"], strict=True):
            e.load_state_dict(sd)
        ref_opt.load_state_dict(state["opt"])
        _train_both(model, zopt, reference, global_batches(4, 1, 2, 2)[3:])
        _matches_reference(model, ref, experts[rank])
    # Both experts' parameters on one group of both ranks: one instance where the
    # checkpoint has two is refused, naming the mismatch.
    model, zopt = _engine(3, 0, Group())
    with pytest.raises(ModelMismatchError, match="saved with 2 instance"):
        zs.load_checkpoint(model, zopt, f"{root}/s3")


def test_expert_checkpoint_loads_at_another_world_size(world4_checkpoints: Path) -> None:
    run_ranks(_load_at_world2, 2, str(world4_checkpoints))


def test_expert_checkpoint_consolidates_one_instance(
    world4_checkpoints: Path, tmp_path: Path
) -> None:
    src = world4_checkpoints / "s3"
    with pytest.raises(CheckpointError, match="consolidate one instance at a time"):
        consolidate(src, tmp_path / "all.safetensors")
    for k in (0, 1):
        out = tmp_path / f"instance{k}.safetensors"
        if k == 0:
            consolidate(src, out, instance=k)
        else:
            assert cli_main(["consolidate", str(src), str(out), "--instance", "1", "--quiet"]) == 0
        want = torch.load(world4_checkpoints / f"s3-instance{k}.pt")
        got = load_file(out)
        assert set(got) == set(want)
        for name, value in got.items():
            torch.testing.assert_close(value, want[name], rtol=0, atol=0, msg=name)
    meta = json.loads((src / "step-3" / "metadata.json").read_text())
    assert meta["version"] == 6  # the optimizers recorded
    expert_sets = [g["rank_sets"] for g in meta["groups"] if "rank_sets" in g]
    assert expert_sets and all(sets == [[0, 2], [1, 3]] for sets in expert_sets)
