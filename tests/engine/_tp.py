"""A small model that torch's tensor parallelism splits, its two plans, and its reference.

`TPModel` is an embedding, two residual MLP blocks, a final norm and an untied head,
with a buffer. `tp_plan(sp=False)` is Megatron's: a vocab-split embedding
(RowwiseParallel), colwise `up`, rowwise `down`, a colwise head gathering its output,
and the norms plain parameters replicated over tp. `tp_plan(sp=True)` is torchtitan's
with sequence parallelism: the residual stream split along the sequence between blocks,
the norms `SequenceParallel` (their gradients `Partial` over tp), `up` gathering the
sequence and `down` reduce-scattering it. The sequence length must divide by tp.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.engine._models import Block

VOCAB = 32
SEQ = 8  # tokens per sequence (inputs; one more for the targets)


class TPModel(nn.Module):
    """Sizes that divide by 2 where tensor parallelism cuts (vocab, hidden), odd elsewhere."""

    def __init__(self, d: int = 10, hidden: int = 18) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        # test_parity's residual MLP block: x + down(gelu(up(norm(x)))).
        self.blocks = nn.ModuleList([Block(d, hidden), Block(d, hidden + 4)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # The embedding's output is a plain (local) tensor under both plans.
        x = self.emb(idx) * self.scale.to(self.emb.weight.dtype)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def tp_plan(sp: bool) -> dict[str, Any]:
    """`parallelize_module`'s plan for `TPModel` (see the module docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict[str, Any] = {}
    if not sp:
        plan["emb"] = RowwiseParallel(input_layouts=Replicate())
        plan["head"] = ColwiseParallel(output_layouts=Replicate())
        for i in range(2):
            plan[f"blocks.{i}.up"] = ColwiseParallel()
            plan[f"blocks.{i}.down"] = RowwiseParallel()
        return plan
    plan["emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    plan["norm"] = SequenceParallel()
    plan["head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    for i in range(2):
        plan[f"blocks.{i}.norm"] = SequenceParallel()
        plan[f"blocks.{i}.up"] = ColwiseParallel(input_layouts=Shard(1))
        plan[f"blocks.{i}.down"] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def split_model(mesh: Any, *, sp: bool, seed: int) -> tuple[nn.Module, nn.Module]:
    """A `TPModel` parallelized over `mesh["tp"]`, and an unsplit copy of its weights."""
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(seed)
    model = TPModel().to(mesh.device_type)
    reference = copy.deepcopy(model).cpu()
    parallelize_module(model, mesh["tp"], tp_plan(sp))
    return model, reference


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW in two param groups (no decay on vectors), as training scripts do."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95))


def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy in fp32 (the head gathers the whole vocabulary)."""
    logits = model(tokens[..., :-1])
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[..., 1:].reshape(-1))


def batches(steps: int, accum: int, dp: int, micro: int = 2) -> torch.Tensor:
    """[steps, accum, dp, micro, SEQ + 1] token ids, the same on every rank."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB, (steps, accum, dp, micro, SEQ + 1), generator=g)


def reference_run(
    reference: nn.Module, data: torch.Tensor, clip: float | None
) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Train `reference` in one process on each step's whole global batch: its losses,
    clip norms and final state dict."""
    opt = make_optimizer(reference)
    losses, norms = [], []
    for step in data:
        loss = loss_fn(reference, step.reshape(-1, step.shape[-1]))
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms, {k: v.detach().clone() for k, v in reference.state_dict().items()}


def train(
    model: nn.Module,
    opt: Any,
    data: torch.Tensor,
    steps: range,
    dp_rank: int,
    *,
    clip: float | None,
    in_backward: bool = False,
) -> tuple[list[float], list[float]]:
    """Data-parallel rank `dp_rank`'s part of each step's global batch (`batches(...,
    accum=1, ...)`): the global mean losses and the clip norms (clipped to `clip` if
    given; each backward under `step_in_backward` if `in_backward`)."""
    losses, norms = [], []
    for step in steps:
        loss = loss_fn(model, data[step, 0, dp_rank])
        if in_backward:
            with opt.step_in_backward():
                loss.backward()
        else:
            loss.backward()
        if clip is not None:
            norms.append(float(opt.clip_grad_norm_(clip)))
        opt.step()
        opt.zero_grad()
        total = loss.detach().reshape(1)
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
    return losses, norms


def plan(
    config: Any,
    *,
    sp: bool,
    tp: int = 2,
    optimizers: Callable[[nn.Module], Sequence[torch.optim.Optimizer]] | None = None,
    shard_group_size: int | None = None,
) -> Any:
    """`zeroshard-plan --tp`'s plan of `TPModel` on 4 ranks (micro-batch 2, `tp_plan`'s
    styles), with `optimizers` built on its meta copy, else `make_optimizer`'s param
    groups."""
    from zeroshard.engine.planner._cluster import Cluster
    from zeroshard.engine.planner._tensor_parallel import plan_tensor_parallel
    from zeroshard.engine.planner._tp_split import COLWISE, EMBEDDING, GATHERED, ROWWISE

    with torch.device("meta"):
        meta = TPModel()
    styles = {"emb": EMBEDDING, "head": GATHERED}
    for i in range(2):
        styles.update({f"blocks.{i}.up": COLWISE, f"blocks.{i}.down": ROWWISE})
    kwargs: dict[str, Any] = {}
    if optimizers is not None:
        kwargs["optimizers"] = optimizers(meta)
    else:
        groups = make_optimizer(meta).param_groups
        kwargs["param_group_of"] = {id(p): k for k, pg in enumerate(groups) for p in pg["params"]}
    return plan_tensor_parallel(
        meta,
        config,
        world_size=4,
        tp=tp,
        micro_batch=2,
        seq_len=SEQ,
        sequence_parallel=sp,
        cluster=Cluster(),
        styles=styles,
        shard_group_size=shard_group_size,
        **kwargs,
    )
