"""Parameters on a data-parallel group of their own (experts under expert parallelism).

World 4 = 2 expert-parallel ranks x 2 expert replicas: ranks {0, 2} hold expert 0 and
ranks {1, 3} expert 1 (different values under the same name). The trunk and head are
sharded over all 4 ranks; each expert only over its own pair, and its gradients are
averaged over that pair, as DDP on that group would. The single-process reference holds
both experts, trains on the global batch, and scales each expert's gradient by
world / group size = 2 to follow that convention.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks, subtests
from tests.engine._models import VOCAB, global_batches
from zeroshard.comm import Group

D = 11


class Trunk(nn.Module):
    def __init__(self, expert_seed: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, D)
        self.head = nn.Linear(D, VOCAB)
        torch.manual_seed(100 + expert_seed)
        self.expert = nn.Sequential(nn.Linear(D, 3 * D), nn.GELU(), nn.Linear(3 * D, D))

    def forward(self, tokens: torch.Tensor, expert: nn.Module | None = None) -> torch.Tensor:
        x = self.emb(tokens)
        return self.head(x + (expert or self.expert)(x))


def _loss(model: nn.Module, batch: torch.Tensor, expert: nn.Module | None = None) -> torch.Tensor:
    logits = model(batch[..., :-1], expert)
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch[..., 1:].reshape(-1))


def _case(pairs: dict[int, Group], stage: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = rank % 2
    model = Trunk(mine)
    # The reference: one trunk, both experts.
    ref = Trunk(0)
    experts = [copy.deepcopy(ref.expert), copy.deepcopy(Trunk(1).expert)]
    ref_params = [*ref.emb.parameters(), *ref.head.parameters()]
    ref_opt = torch.optim.SGD(
        [*ref_params, *experts[0].parameters(), *experts[1].parameters()], lr=0.1, momentum=0.9
    )
    cfg = {"stage": stage, "reduce_bucket_bytes": 800}
    if stage == 3:
        cfg.update(unit_modules=["expert"], min_unit_params=1, persistence_threshold=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, zopt = zs.initialize(model, opt, cfg, process_groups={"expert": pairs[mine]})
    batches = global_batches(3, 1, world, 2)
    for step in range(3):
        _loss(model, batches[step, 0, rank]).backward()
        zopt.step()
        zopt.zero_grad()
        loss = sum(_loss(ref, batches[step, 0, r], experts[r % 2]) for r in range(world))
        (loss / world).backward()
        for e in experts:
            for p in e.parameters():
                p.grad.mul_(2)  # averaged over its pair of ranks, not over all four
        ref_opt.step()
        ref_opt.zero_grad()
    full = zs.full_state_dict(model)
    want = {**ref.state_dict(), **{f"expert.{k}": v for k, v in experts[mine].state_dict().items()}}
    for name, value in want.items():
        torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="cannot be checkpointed yet"):
        zs.save_checkpoint(model, zopt, "/nonexistent", step=0)


def _expert_groups() -> None:
    # Every rank creates both subgroups, in the same order.
    pairs = {e: Group(dist.new_group([e, e + 2])) for e in (0, 1)}
    run_each(subtests({"stage": [1, 2, 3]}), lambda stage: _case(pairs, stage))


def test_expert_parameters_on_their_own_group() -> None:
    run_ranks(_expert_groups, 4)
