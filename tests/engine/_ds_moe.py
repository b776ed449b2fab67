"""A DeepSpeed MoE checkpoint written by DeepSpeed 0.19.8 itself, and its model.

`MoELM`: an embedding, a LayerNorm, DeepSpeed's own MoE layer (`deepspeed.moe.layer.MoE`:
4 experts over expert-parallel size 2, top-1 gating with a capacity that drops no token)
and a head. `write_checkpoint` (on 2 gloo ranks, `run_ranks`) trains it with DeepSpeed
ZeRO-2 and AdamW for 2 steps, each expert started from its own values, saves
`global_step2`, and trains 2 more steps: `resume.json` holds their batches and losses,
`continued.safetensors` DeepSpeed's weights after them and `moments.safetensors` the Adam
moments DeepSpeed's live optimizer held at the save (`exp_avg/NAME`), every expert under
its global name (`moe.deepspeed_moe.experts.deepspeed_experts.{E}.…`, E = expert-parallel
rank * 2 + local index, as DeepSpeed's expert files name them).

A zeroshard run keeps the model's code: DeepSpeed's MoE layer, its expert-parallel groups
made as `deepspeed.initialize` makes them (`expert_data_group`), the experts on the
expert data-parallel group as a process group of their own, their gradients divided by
the world as DeepSpeed divides them (`gradient_divide_factor`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

VOCAB, DIM, HIDDEN, EXPERTS, EP = 37, 16, 8, 4, 2
STEPS, RESUME_STEPS, GLOBAL_BATCH, SEQ = 2, 2, 4, 5
TAG = f"global_step{STEPS}"
EXPERTS_PATH = "moe.deepspeed_moe.experts"
LOCAL = "moe.deepspeed_moe.experts.deepspeed_experts."


def deepspeed_module() -> Any:
    """`deepspeed`, its communication joined to this rank's gloo group."""
    import sys

    import deepspeed

    # DeepSpeed's CPU backend JIT-compiles a shared-memory allreduce (a minute of C++ on
    # a fresh machine) that gloo's collectives replace, the checkpoint alike.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # type: ignore[attr-defined]
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class MoELM(nn.Module):
    """Embedding, norm, DeepSpeed's MoE layer (a residual around it) and a head."""

    def __init__(self, experts: int = EXPERTS) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        # No token dropped (capacity: every token of a rank), none chosen at random.
        self.moe = MoE(
            DIM, Expert(), num_experts=experts, ep_size=EP, k=1, min_capacity=10, use_rts=False
        )
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        out, _, _ = self.moe(self.norm(h))
        return self.head(h + out)


def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())


def expert_rank() -> int:
    """This rank's expert-parallel rank (DeepSpeed's default topology: rank % ep size)."""
    return dist.get_rank() % EP


def global_name(name: str, experts: int = EXPERTS) -> str:
    """A local expert parameter's name as DeepSpeed's files give it (its global expert)."""
    if not name.startswith(LOCAL):
        return name
    local, rest = name.removeprefix(LOCAL).split(".", 1)
    return f"{LOCAL}{expert_rank() * (experts // EP) + int(local)}.{rest}"


def expert_data_group(model: nn.Module) -> Any:
    """Make the MoE layer's expert-parallel groups as deepspeed.initialize does (collective);
    return this rank's expert data-parallel group (its experts' replicas)."""
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups

    for m in model.modules():
        if isinstance(m, MoE):
            m.set_deepspeed_parallelism()
    return groups._get_expert_data_parallel_group(f"ep_size_{EP}")


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """No weight decay on the norm; the experts in param groups of their own, as DeepSpeed
    MoE needs (its `split_params_into_different_moe_groups_for_optimizer`)."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    named = list(model.named_parameters())
    groups = [
        {"name": "decay", "params": [p for n, p in named if "norm" not in n], "weight_decay": 0.1},
        {"name": "no_decay", "params": [p for n, p in named if "norm" in n], "weight_decay": 0.0},
    ]
    return split_params_into_different_moe_groups_for_optimizer(groups)  # type: ignore[no-any-return]


def batches() -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (STEPS + RESUME_STEPS, GLOBAL_BATCH, SEQ), generator=gen)


def rows(batch: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a global batch."""
    per = batch.shape[0] // dist.get_world_size()
    return batch[dist.get_rank() * per : (dist.get_rank() + 1) * per]


def _moments(engine: Any, model: nn.Module) -> dict[str, torch.Tensor]:
    """DeepSpeed's live Adam moments of this rank's parameters, by global name."""
    from deepspeed.utils import lazy_init_hp_params_optimizer_state, safe_get_full_optimizer_state

    zero = engine.optimizer
    # deepspeed 0.19.8 links only the first param group's parameters to their state (see
    # tests/ckpt/fixtures/deepspeed/make_fixtures.py's _moments): link every group.
    for lp, hp in zip(zero.bit16_groups, zero.single_partition_of_fp32_groups, strict=True):
        lazy_init_hp_params_optimizer_state(lp, hp, zero.optimizer.state)
    return {
        f"{key}/{global_name(n)}": safe_get_full_optimizer_state(p, key).detach().clone()
        for n, p in model.named_parameters()
        for key in ("exp_avg", "exp_avg_sq")
    }


def _gathered(mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: v.contiguous() for rank in every for k, v in rank.items()}


def write_checkpoint(root: str) -> None:
    """DeepSpeed trains MoELM 2 steps, saves, trains 2 more (see the module docstring)."""
    ds = deepspeed_module()
    torch.manual_seed(0)
    model = MoELM()
    with torch.no_grad():  # every expert its own values (DeepSpeed copies one expert)
        for n, p in model.named_parameters():
            if n.startswith(LOCAL):
                g = torch.Generator().manual_seed(sum(map(ord, global_name(n))))
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    config = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dist.get_world_size(),
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 64, "allgather_bucket_size": 64},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2)
    engine, *_ = ds.initialize(model=model, optimizer=opt, config=config)
    losses = []
    for step, batch in enumerate(batches()):
        if step == STEPS:
            engine.save_checkpoint(root, tag=TAG)
            moments = _gathered(_moments(engine, model))
            adam_step = {float(s["step"]) for s in engine.optimizer.optimizer.state.values()}
        tokens = rows(batch)
        loss = loss_fn(engine, tokens)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    weights = _gathered({global_name(n): p.detach().clone() for n, p in model.named_parameters()})
    if dist.get_rank() == 0:
        save_file(weights, f"{root}/continued.safetensors")
        save_file(moments, f"{root}/moments.safetensors")
        (adam,) = adam_step
        meta = {"losses": losses[STEPS:], "adam_step": adam}
        Path(root, "resume.json").write_text(json.dumps(meta))
        for script in Path(root).glob("zero_to_*.py"):
            script.unlink()
    dist.barrier()
