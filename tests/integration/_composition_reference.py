"""The composition parity test's reference: plain torch in one process, one replica of
the model per data-parallel rank, each feature's reference rule composed
(test_composition_parity.py's docstring lists them).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from tests.integration.test_composition import FIXTURE, Recipe, _model, _optimizers, fill

OWN_MODULE = "blocks.1."  # the module `build` puts on a group of its own


def rank_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The loss `build`'s step (and DeepSpeed's fixture run) computes on a rank's rows."""
    out = model(tokens).float().flatten(0, 1)
    return nn.functional.cross_entropy(out, tokens.flatten())


def _fixtures() -> Any:
    sys.path.insert(0, str(FIXTURE.parent))
    try:
        import make_fixtures
    finally:
        sys.path.remove(str(FIXTURE.parent))
    return make_fixtures


def _deepspeed_weights() -> dict[str, torch.Tensor]:
    """The module's weights DeepSpeed's fixture saved at its checkpoint (fp32: its masters)."""
    path = FIXTURE / "global_step2" / "mp_rank_00_model_states.pt"
    module: dict[str, torch.Tensor] = torch.load(path, weights_only=False)["module"]
    return module


def _deepspeed_state(model: nn.Module, opts: list[torch.optim.Optimizer]) -> None:
    """The optimizer state DeepSpeed's fixture holds at its checkpoint, into `model`'s
    Adam(W): the moments and step DeepSpeed's live optimizer held, and the
    hyperparameters it trained with."""
    moments = load_file(FIXTURE / "moments.safetensors")
    step = json.loads((FIXTURE / "resume.json").read_text())["adam_step"]
    theirs = _fixtures().make_optimizer(model).param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    (opt,) = opts
    assert type(opt) in (torch.optim.Adam, torch.optim.AdamW), "DeepSpeed's state is Adam's"
    for ours, group in zip(opt.param_groups, theirs, strict=True):
        assert {id(p) for p in ours["params"]} == {id(p) for p in group["params"]}
        for key in ("lr", "betas", "eps", "weight_decay"):
            ours[key] = group[key]
        for p in ours["params"]:
            n = names[id(p)]
            opt.state[p] = {
                "step": torch.tensor(float(step)),
                "exp_avg": moments[f"exp_avg/{n}"].to(p.dtype),
                "exp_avg_sq": moments[f"exp_avg_sq/{n}"].to(p.dtype),
            }


@dataclass
class Reference:
    """A recipe's plain torch run in one process: a replica per data-parallel rank."""

    live: list[nn.Module]  # what each replica's forward computes with
    masters: list[nn.Module]  # what its optimizers step: `live` itself where they are one
    opts: list[list[torch.optim.Optimizer]]
    delayed: bool  # forward computes with the weights one step behind the masters
    loss_scale: float  # fp16's: the loss is scaled, the gradients unscaled into the masters

    @classmethod
    def of(cls, r: Recipe, dp: int) -> Reference:
        """The replicas of `r` at its start (see the module docstring)."""
        base = _model(dataclasses.replace(r, meta=False), None, float8_gather=False)
        with torch.no_grad():
            if r.meta:
                for name, p in base.named_parameters():
                    fill(name, p)
            if r.deepspeed:
                base.load_state_dict(_deepspeed_weights())
        if r.config.get("master_dtype") == "bf16":
            for p in base.parameters():
                p.data = p.data.to(torch.bfloat16)
        masters = [copy.deepcopy(base) for _ in range(dp)]
        delayed = bool(r.config.get("offload_delay_param_update"))
        fp16 = r.config.get("compute_dtype") == "fp16"
        live = masters
        if delayed or fp16:
            live = [copy.deepcopy(m).to(torch.float16 if fp16 else torch.float32) for m in masters]
        opts = [_optimizers(r, m) for m in masters]
        if r.deepspeed:
            for m, o in zip(masters, opts, strict=True):
                _deepspeed_state(m, o)
        scale = float(r.config["initial_loss_scale"]) if fp16 else 1.0
        return cls(live, masters, opts, delayed, scale)

    def step(self, batch: torch.Tensor, own: bool = False, clip: float | None = None) -> float:
        """One step on the global `batch` (each replica its rows); the mean loss. With
        `own`, the own group's parameters keep their replica's gradient."""
        losses = []
        for model, rows in zip(self.live, batch.chunk(len(self.live)), strict=True):
            loss = rank_loss(model, rows)
            (loss * self.loss_scale).backward()
            losses.append(float(loss.detach()))
        live = [dict(m.named_parameters()) for m in self.live]
        masters = [dict(m.named_parameters()) for m in self.masters]
        for name, p in live[0].items():
            if p.grad is None:
                continue
            grads = [n[name].grad.float() / self.loss_scale for n in live]
            mean = torch.stack(grads).mean(0)
            for i, (n, m) in enumerate(zip(live, masters, strict=True)):
                g = grads[i] if own and name.startswith(OWN_MODULE) else mean
                n[name].grad = None
                m[name].grad = g.to(m[name].dtype)
        for model, master, opts in zip(self.live, self.masters, self.opts, strict=True):
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(master.parameters(), clip)
            if self.delayed:
                _copy(master, model)  # step() k publishes the weights of step k-1
            for o in opts:
                o.step()
                o.zero_grad()
            if model is not master and not self.delayed:
                _copy(master, model)
        return sum(losses) / len(losses)

    def publish(self) -> None:
        """Forward computes with the masters from now (a delayed run resumed)."""
        for model, master in zip(self.live, self.masters, strict=True):
            _copy(master, model)

    def weights(self, replica: int) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.masters[replica].state_dict().items()}


def _copy(source: nn.Module, to: nn.Module) -> None:
    with torch.no_grad():
        for a, b in zip(source.parameters(), to.parameters(), strict=True):
            b.copy_(a)
