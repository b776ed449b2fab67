"""CPU offload under tensor parallelism (`initialize(..., device_mesh=...)` with
`offload_optimizer`), on 4 gloo ranks, against a plain single-process PyTorch run of the
unsplit model on the global batch (fp32: rtol 1e-5 / atol 1e-6).

A host group holds its rank's local tp pieces as a device group does; the cases:

- `offload_optimizer` at stage 2, dp 2 x tp 2, clipping (the clip norm counts a split
  group's host shards once per tp rank, a replicated group's once);
- `offload_params` at stage 3 with sequence parallelism (the norms' `Partial` gradients
  all-reduced over tp before they go to the host), a share left on the device
  (`offload_ratio`), clipping;
- `step_in_backward` at stage 3, part offloaded: each host group stepped as its
  gradient lands;
- `delay_param_update` at stage 2 with clipping, against the reference with the lag
  applied by hand (and not the unlagged one);
- a 3-D mesh, (dp_replicate, dp_shard, tp) = (2, 1, 2) at stage 3 with
  `offload_params`: the host gradient shards averaged over the replicas.
- torch's Muon recipe at stage 2, fully offloaded: Muon's momentum on the host, each
  split matrix's pieces brought whole to its owner's device and orthogonalized there.

At stage 2, and at stage 3 with `offload_params`, `zeroshard-plan --tp 2`'s host bytes and
device model states per rank are the engine's, to the byte. At stage 3 the state API
(`full_grad`, `grad_norms`, `full_optimizer_state`, `gathered_parameters`,
`model.state_dict()` and `load_state_dict` of whole tensors, `state_dict_on_rank0`,
`load_safetensors`) gives and takes the same bits with `offload_params` as without.

Each case saves a checkpoint after two of its three steps; a fresh engine of the
same combination loads it and trains that step bit for bit (under `delay_param_update`
the loaded masters and optimizer state are the saved ones bit for bit: its first step
after a load computes at the loaded weights, without the lag). The 2-D cases' checkpoints
also load into the unsplit model at dp 4 without a mesh, offloaded alike, and take that
step as the split run did.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks
from tests.engine import _tp
from tests.engine._models import muon_and_adamw
from tests.engine.test_tensor_parallel import engine_config
from tests.engine.test_tensor_parallel_compositions import _dp, _mesh

STEPS = 3
CLIP = 0.5


def _adamw(model: nn.Module, fused: bool) -> torch.optim.Optimizer:
    """`_tp.make_optimizer`'s AdamW; fused is what the delayed step takes."""
    groups = [
        {k: g[k] for k in ("params", "weight_decay")}
        for g in _tp.make_optimizer(model).param_groups
    ]
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), fused=fused)


def _optimizers(model: nn.Module, muon: bool, fused: bool) -> list[torch.optim.Optimizer]:
    """torch's Muon recipe (Muon on the hidden matrices, AdamW on the rest), or AdamW."""
    return muon_and_adamw(model) if muon else [_adamw(model, fused)]


def _planned_host_matches(model: nn.Module, opt: zs.ZeroOptimizer, sp: bool) -> None:
    """`zeroshard-plan --tp 2`'s model states and offload host bytes per rank are this
    engine's (after a step: AdamW's state exists), to the byte."""
    state = zs.engine_state(model)
    host = state.offload
    assert host is not None
    plan = _tp.plan(state.config, sp=sp)
    on_host = [g for g in state.groups if host.holds(g)]
    on_device = [g for g in state.groups if not host.holds(g)]
    held = sum(t.nbytes for g in on_host for t in opt.state[g.master].values() if t.dim())
    # On the CPU nothing is pinned; the same buffers are allocated pageable.
    assert plan.host == host.nbytes().host + held, (plan.host, host.nbytes().host, held)
    assert plan.states["master"] == sum(g.master.nbytes for g in on_device), plan.states
    assert plan.states["offload_compute"] == host.nbytes().device, plan.states


def _reference(
    model: nn.Module, data: torch.Tensor, clip: bool, lag: bool, muon: bool
) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Losses, clip norms and final masters of `model` (unsplit) trained in one process
    on each step's whole global batch; with `lag`, forward computes with the masters of
    the step before the last (see tests/engine/test_offload_delayed.py)."""
    live, master = model, copy.deepcopy(model)
    opts = _optimizers(master, muon, lag)
    pairs = list(zip(live.parameters(), master.parameters(), strict=True))
    losses, norms = [], []
    for step in data:
        loss = _tp.loss_fn(live, step.reshape(-1, step.shape[-1]))
        loss.backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(live.parameters(), CLIP)))
        for p_live, p_master in pairs:
            p_master.grad, p_live.grad = p_live.grad, None
            if lag:
                p_live.data.copy_(p_master.data)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        if not lag:
            for p_live, p_master in pairs:
                p_live.data.copy_(p_master.data)
        losses.append(float(loss.detach()))
    return losses, norms, {k: v.detach().clone() for k, v in master.state_dict().items()}


def _state(opt: zs.ZeroOptimizer) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in opt.state[g.master].items()} for g in opt.flat_groups]


def _case(
    shape: tuple[int, ...],
    stage: int,
    sp: bool,
    offload: dict[str, Any],
    root: str,
    clip: bool = True,
    in_backward: bool = False,
    planned: bool = False,
    muon: bool = False,
) -> None:
    mesh = _mesh(shape)
    delayed = bool(offload.get("offload_delay_param_update"))
    config = {**engine_config(stage, "fp32"), "offload_optimizer": True, **offload}

    def build() -> tuple[nn.Module, zs.ZeroOptimizer]:
        model, _ = _tp.split_model(mesh, sp=sp, seed=stage)
        opts = _optimizers(model, muon, delayed)
        return zs.initialize(model, opts if muon else opts[0], config, device_mesh=mesh)

    data = _tp.batches(STEPS, 1, _dp(mesh)[0])

    def train(m: nn.Module, o: zs.ZeroOptimizer, steps: range) -> tuple[list[float], list[float]]:
        max_norm = CLIP if clip else None
        return _tp.train(m, o, data, steps, _dp(mesh)[1], clip=max_norm, in_backward=in_backward)

    _, reference = _tp.split_model(mesh, sp=sp, seed=stage)
    ref_losses, ref_norms, ref_state = _reference(
        copy.deepcopy(reference), data, clip, delayed, muon
    )
    model, opt = build()
    homes = {g.home.kind for g in opt.flat_groups if g.trainable}
    want = {zs.HomeKind.HOST} if offload.get("offload_ratio", 1.0) == 1 else set(zs.HomeKind)
    assert homes == want, homes
    # Two steps, a checkpoint of the combination, the third step.
    path = Path(root) / f"{'x'.join(map(str, shape))}s{stage}{sorted(offload)}{'muon' * muon}"
    losses, norms = train(model, opt, range(2))
    zs.save_checkpoint(model, opt, path, step=2, overwrite=True)
    saved, saved_state = zs.full_state_dict(model), _state(opt)
    more = train(model, opt, range(2, STEPS))
    torch.testing.assert_close(losses + more[0], ref_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norms + more[1], ref_norms, rtol=1e-5, atol=1e-6)
    if planned:
        _planned_host_matches(model, opt, sp)
    full = zs.full_state_dict(model)
    for k, v in ref_state.items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=k)
    if delayed:
        _, _, unlagged = _reference(copy.deepcopy(reference), data, clip, False, muon)
        assert not all(torch.allclose(full[k], v, 1e-5, 1e-6) for k, v in unlagged.items())

    # The same combination resumed from the checkpoint.
    again, opt2 = build()
    assert zs.load_checkpoint(again, opt2, path) == 2
    if delayed:
        for k, v in zs.full_state_dict(again).items():
            assert torch.equal(v, saved[k]), k
        torch.testing.assert_close(_state(opt2), saved_state, rtol=0, atol=0)
        return
    train(again, opt2, range(2, 3))
    got = zs.full_state_dict(again)
    for k, v in full.items():
        assert torch.equal(got[k], v), f"{k}: the resume is not bit-identical"
    if len(shape) == 2:
        _loads_without_tp(config, path, data, saved, full, clip, muon)


def _loads_without_tp(
    config: dict[str, Any],
    path: Path,
    data: torch.Tensor,
    saved: dict[str, torch.Tensor],
    after: dict[str, torch.Tensor],
    clip: bool,
    muon: bool,
) -> None:
    """The checkpoint of a split run loads into the unsplit model at dp 4, offloaded alike:
    the saved weights bit for bit, and the third step (its host optimizer state the split
    run's, joined) as the split run took it."""
    rank = dist.get_rank()
    torch.manual_seed(99)  # every weight must come from the checkpoint
    plain = _tp.TPModel()
    opts = _optimizers(plain, muon, False)
    plain, opt = zs.initialize(plain, opts if muon else opts[0], config)
    assert zs.load_checkpoint(plain, opt, path) == 2
    for k, v in zs.full_state_dict(plain).items():
        assert torch.equal(v, saved[k]), k
    tokens = data[2, 0].reshape(-1, data.shape[-1])[rank : rank + 1]
    _tp.loss_fn(plain, tokens).backward()
    if clip:
        opt.clip_grad_norm_(CLIP)
    opt.step()
    full = zs.full_state_dict(plain)
    for k, v in after.items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=k)


CASES: list[dict[str, Any]] = [
    dict(shape=(2, 2), stage=2, sp=False, offload={}, planned=True),
    dict(
        shape=(2, 2),
        stage=3,
        sp=True,
        offload={"offload_params": True, "offload_ratio": 0.5},
        planned=True,
    ),
    dict(
        shape=(2, 2),
        stage=3,
        sp=True,
        offload={"offload_ratio": 0.5},
        clip=False,
        in_backward=True,
    ),
    dict(shape=(2, 2), stage=2, sp=False, offload={"offload_delay_param_update": True}),
    dict(shape=(2, 1, 2), stage=3, sp=True, offload={"offload_params": True}),
    dict(shape=(2, 2), stage=2, sp=False, offload={}, muon=True),
]


def _state_apis(root: str) -> dict[str, Any]:
    """What the state API reads and writes, for stage 3 at dp 2 x tp 2 with sequence
    parallelism (device homes, or `offload_params`) in the same steps."""
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    mesh = _mesh((2, 2))
    me = mesh.get_local_rank("dp")
    data = _tp.batches(2, 1, 2)
    out: dict[str, dict[str, Any]] = {}
    for offload in (False, True):
        model, _ = _tp.split_model(mesh, sp=True, seed=3)
        cfg = {**engine_config(3, "fp32"), "offload_optimizer": offload, "offload_params": offload}
        model, opt = zs.initialize(model, _adamw(model, True), cfg, device_mesh=mesh)
        r: dict[str, Any] = {}
        for step in range(2):
            _tp.loss_fn(model, data[step, 0, me]).backward()
            r[f"norms{step}"] = zs.grad_norms(model)
            for name in ("blocks.0.up.weight", "blocks.1.down.weight", "blocks.0.norm.weight"):
                r[f"grad{step} {name}"] = zs.full_grad(model, name)
            opt.step()
            opt.zero_grad()
        for name in ("blocks.0.down.weight", "emb.weight", "norm.bias"):
            r[f"state {name}"] = zs.full_optimizer_state(model, name)
        with zs.gathered_parameters(model):
            r["gathered"] = model.blocks[0].up.weight.full_tensor().clone()
        whole = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).clone()
            for k, v in model.state_dict().items()
        }
        r["state_dict"] = whole
        with zs.state_dict_on_rank0(model):
            r["on rank 0"] = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict({k: v * 0.5 for k, v in whole.items()})
        r["load_state_dict"] = zs.full_state_dict(model)
        file = Path(root) / f"weights{offload}.safetensors"
        if dist.get_rank() == 0:
            save_file({k: v.contiguous() for k, v in whole.items()}, file)
        dist.barrier()
        zs.load_safetensors(model, file)
        _tp.loss_fn(model, data[1, 0, me]).backward()
        opt.step()
        r["a step after load_safetensors"] = zs.full_state_dict(model)
        out["host" if offload else "device"] = r
    return out


def _same_state_apis(root: str) -> None:
    """The state API sees no home: offloaded pieces read and load as the device's do, bit
    for bit (gradients, norms, optimizer state, gathered and state-dict values, loads)."""
    apis = _state_apis(root)
    # Nothing compared is empty (a gradient read when none is held, a state before a step).
    # ("on rank 0" is {} on the other ranks.)
    held = {k: v for k, v in apis["host"].items() if k != "on rank 0"}
    assert all(v is not None and len(v) for v in held.values()), held.keys()

    def same(a: Any, b: Any, where: str) -> None:
        if isinstance(a, dict):
            assert a.keys() == b.keys(), where
            for k in a:
                same(a[k], b[k], f"{where}: {k}")
        elif isinstance(a, torch.Tensor):
            assert torch.equal(a.cpu(), b.cpu()), where
        else:
            assert a == b, (where, a, b)

    same(apis["device"], apis["host"], "device vs host")


def _all(root: str) -> None:
    run_each(CASES, lambda **c: _case(**c, root=root))
    run_each([{}], lambda: _same_state_apis(root))
    # The 3-D mesh's replicas finish apart (nothing after the last save spans both): the
    # first must not leave, taking the store rank 0 holds, while the other still works.
    dist.barrier()


def test_tensor_parallel_offload(tmp_path: Path) -> None:
    """Offload's homes and schedules under tensor parallelism (see the module docstring)."""
    run_ranks(_all, 4, str(tmp_path), timeout_s=300)
