"""`initialize(..., gradient_divide_factor=f)`: groups of their own divide their summed
gradients by f instead of their size (experts fed by an all-to-all: DeepSpeed MoE's and
torchtitan's division by the whole data-parallel world).

2 ranks, f = 4: each rank's `expert` alone on a group of one rank (its own values, as
expert-parallel rank r's experts) and a `shared` block on a group of both ranks (one
value, its gradients summed over the two); the rest averaged over the world as always.
The single-process reference holds the trunk, `shared` and both experts, backpropagates
the mean of the ranks' losses and multiplies the own groups' gradients by world / f, so
each is the sum over its ranks' gradients divided by f; torch's `clip_grad_norm_` then
clips the divided gradients, as DeepSpeed clips. Each case trains 3 clipped steps: the
clip norm and every weight match, at stages 1, 2 and 3, under `zeroshard.compile` (its
async collectives, the ops' own, and the host groups' gradients of offload), with the
optimizer (and the parameters) offloaded, and in fp16 (loss scaled, unscaled and clipped
after the division), each offloaded group stepped in backward (`step_in_backward`, not
clipped: it refuses clipping) and with the step a window late (`delay_param_update`, torch's
fused AdamW: the reference computes each window at the masters before their last step). A
bad factor is refused by name on every rank, and so is a factor beside `optimizer=None`
(no gradient is ever reduced there).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zeroshard.compile as zc
import zeroshard.engine as zs
from tests._dist import run_each, run_ranks
from tests.engine._models import VOCAB, global_batches
from zeroshard.comm import Group

D = 12
FACTOR = 4
MAX_NORM = 0.5
STEPS = 3


class Model(nn.Module):
    def __init__(self, expert_seed: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, D)
        self.shared = nn.Linear(D, D)
        self.head = nn.Linear(D, VOCAB)
        torch.manual_seed(100 + expert_seed)
        self.expert = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, tokens: torch.Tensor, expert: nn.Module | None = None) -> torch.Tensor:
        x = self.emb(tokens)
        x = x + self.shared(x)
        return self.head(x + (expert or self.expert)(x))


def _loss(model: nn.Module, batch: torch.Tensor, expert: nn.Module | None = None) -> torch.Tensor:
    logits = model(batch[..., :-1], expert)
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), batch[..., 1:].reshape(-1))


def _params(model: Model, experts: list[nn.Module]) -> tuple[list[nn.Parameter], ...]:
    """The parameters of the own groups (`shared`, the experts), and all of them."""
    own = [*model.shared.parameters(), *(p for e in experts for p in e.parameters())]
    return own, [*model.emb.parameters(), *model.head.parameters(), *own]


def _optimizer(params: list[nn.Parameter], delayed: bool) -> torch.optim.Optimizer:
    """SGD with momentum; delay_param_update steps only torch's fused Adam/AdamW."""
    if delayed:
        return torch.optim.AdamW(params, lr=1e-2, fused=True)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


class Reference:
    """The trunk, `shared` and both experts in one process, on the global batch; with
    `delayed`, forward and backward compute at `live`, the masters before their last step
    (delay_param_update's lag, as tests/engine/test_offload_delayed.py applies it)."""

    def __init__(self, world: int, *, delayed: bool = False) -> None:
        self.model = Model(0)
        self.experts = [copy.deepcopy(Model(r).expert) for r in range(world)]
        self.own, self.params = _params(self.model, self.experts)
        self.opt = _optimizer(self.params, delayed)
        self.live = copy.deepcopy((self.model, self.experts)) if delayed else None

    def step(self, batches: torch.Tensor, clip: bool = True) -> torch.Tensor | None:
        """One step, rank r's batch `batches[r]` through expert r; the clip norm if `clip`."""
        world = len(self.experts)
        model, experts = self.live or (self.model, self.experts)
        loss = sum(_loss(model, batches[r], experts[r]) for r in range(world))
        (loss / world).backward()
        if self.live is not None:  # the gradients to the masters, the masters to `live`
            with torch.no_grad():
                for live, master in zip(_params(*self.live)[1], self.params, strict=True):
                    master.grad, live.grad = live.grad, None
                    live.copy_(master)
        for p in self.own:  # the sum over the group's ranks, divided by the factor
            p.grad.mul_(world / FACTOR)
        norm = torch.nn.utils.clip_grad_norm_(self.params, MAX_NORM) if clip else None
        self.opt.step()
        self.opt.zero_grad()
        return norm

    def full(self, rank: int) -> dict[str, torch.Tensor]:
        """What `rank`'s full state dict should hold: the trunk, `shared`, its expert."""
        sd = {k: v for k, v in self.model.state_dict().items() if not k.startswith("expert.")}
        sd.update({f"expert.{k}": v for k, v in self.experts[rank].state_dict().items()})
        return sd


CASES: list[dict[str, Any]] = [
    {"stage": 1},
    {"stage": 2},
    {"stage": 3},
    {"stage": 3, "compiled": "async"},
    # The ops' own collectives, which `issue_async` otherwise rewrites.
    {"stage": 3, "compiled": "in the ops"},
    {"stage": 3, "compiled": "async", "offload_optimizer": True},
    {"stage": 2, "offload_optimizer": True},
    {"stage": 3, "offload_optimizer": True, "offload_params": True},
    {"stage": 2, "compute_dtype": "fp16", "initial_loss_scale": 1024.0},
    # Each offloaded group stepped as its divided gradient lands on the host.
    {"stage": 2, "offload_optimizer": True, "early": True},
    {"stage": 3, "offload_optimizer": True, "offload_params": True, "early": True},
    # The step of the divided gradients run beside the next window.
    {"stage": 1, "offload_optimizer": True, "offload_delay_param_update": True},
    {"stage": 2, "offload_optimizer": True, "offload_delay_param_update": True},
]


def _case(
    groups: dict[str, Group], stage: int, compiled: str = "", early: bool = False, **extra: Any
) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    delayed = bool(extra.get("offload_delay_param_update"))
    cfg: dict[str, Any] = {"stage": stage, "reduce_bucket_bytes": 800, **extra}
    if stage == 3:
        cfg.update(unit_modules=["expert", "shared"], min_unit_params=1, persistence_threshold=0)
    model = Model(rank)
    opt = _optimizer([*model.parameters()], delayed)
    model, zopt = zs.initialize(
        model, opt, cfg, process_groups=groups, gradient_divide_factor=FACTOR
    )
    run: nn.Module = model
    if compiled:
        pipeline = zc.default_pipeline()
        if compiled == "in the ops":
            pipeline = pipeline.without("issue_async")
        run = zc.compile(model, backend="aot_eager", pipeline=pipeline)
    ref = Reference(world, delayed=delayed)
    # fp16 computes in 11 bits (test_composition_parity.py's fp16 tolerance); a wrong
    # division is a factor of 2 or more.
    rtol, atol = (2e-2, 1e-2) if "compute_dtype" in extra else (1e-5, 1e-6)
    for batches in global_batches(STEPS, 1, world, 2)[:, 0]:
        with zopt.step_in_backward() if early else contextlib.nullcontext():
            _loss(run, batches[rank]).backward()
        norm = None if early else zopt.clip_grad_norm_(MAX_NORM)
        zopt.step()
        zopt.zero_grad()
        want = ref.step(batches, clip=not early)
        if norm is not None and want is not None:
            assert want > MAX_NORM  # the clipping bites
            torch.testing.assert_close(norm, want, rtol=rtol, atol=0)
        full = zs.full_state_dict(run)
        for name, value in ref.full(rank).items():
            torch.testing.assert_close(full[name], value, rtol=rtol, atol=atol, msg=name)


def _refused(groups: dict[str, Group]) -> None:
    rank = dist.get_rank()
    bad: list[tuple[Any, dict[str, Group], type[Exception], str]] = [
        (0, groups, ValueError, "finite positive number, not 0"),
        (-2.0, groups, ValueError, "finite positive number, not -2.0"),
        (float("nan"), groups, ValueError, "finite positive number, not nan"),
        (float("inf"), groups, ValueError, "finite positive number, not inf"),
        ("4", groups, TypeError, "must be a number .* not str '4'"),
        (True, groups, TypeError, "must be a number .* not bool True"),
        (4, {}, ValueError, "no process_groups were given"),
        # Ranks that pass other factors would divide the same sum otherwise.
        (2 + 2 * rank, groups, ValueError, "gradient_divide_factor"),
    ]
    for factor, given, error, why in bad:
        model = Model(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(error, match=why):
            zs.initialize(
                model, opt, {"stage": 2}, process_groups=given, gradient_divide_factor=factor
            )
    # Without an optimizer nothing is reduced (backward is refused): nothing to divide.
    with pytest.raises(ValueError, match=r"gradient_divide_factor=4\.0 .* given no optimizer"):
        zs.initialize(
            Model(0), None, {"stage": 2}, process_groups=groups, gradient_divide_factor=FACTOR
        )


def _divide_factor() -> None:
    rank = dist.get_rank()
    alone = [Group(dist.new_group([r])) for r in range(2)]  # every rank makes both
    groups = {"expert": alone[rank], "shared": Group(dist.new_group([0, 1]))}
    run_each(CASES, lambda **case: _case(groups, **case))
    run_each([{}], lambda: _refused(groups))


def test_own_groups_divide_by_the_factor() -> None:
    run_ranks(_divide_factor, 2, timeout_s=300)
