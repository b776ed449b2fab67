"""The tensor-parallel engines: zeroshard stage 3 (`zs3tp`; compiled, `zs3ctp`) and FSDP2
(`fsdp2tp`) over the dp dim of a (dp, tp) device mesh, the model first split over its tp
dim by torch's tensor parallelism, `--tp` consecutive ranks sharing each layer; and
`zs3m`, zs3 through `initialize(device_mesh=...)` on a (world, 1) mesh with the model
not split (the mesh path alone, without DTensor's dispatch).

The split is Megatron's: `llama` (examples/llama.py) by `LLAMA_PLAN` (torchtitan's plan
without sequence parallelism), `hf-llama` by transformers' own `tp_plan`. At `--tp 1`
the mesh is (world, 1) and every split layer a DTensor on one rank: the device_mesh
path against `zs3`'s. Every rank of a tp group reads the same tokens (the benchmark's
data are the same on every rank), and each GPU computes 1/tp of them (`Result.tp`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks._common import adamw
from benchmarks._common._models import HFCausalLM
from benchmarks.train_step._settings import Settings, Skipped, Stepper, dtype_name
from examples import llama


def llama_plan() -> dict[str, Any]:
    """examples/llama.py's split over tp: vocab-split embedding, colwise q/k/v/gate/up,
    rowwise output projections, a colwise head that gathers its logits."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Replicate()),
    }
    for layer in ("attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up"):
        plan[f"blocks.*.{layer}"] = ColwiseParallel()
    for layer in ("attn.proj", "mlp.proj"):
        plan[f"blocks.*.{layer}"] = RowwiseParallel()
    return plan


def hf_plan(model: nn.Module) -> dict[str, str]:
    """A Hugging Face model's `tp_plan` with its `*` spelled out as transformers applies
    it: each parameter a rule names, then its module."""
    rules = getattr(model, "tp_plan", None) or {}
    patterns = [
        (re.compile(k.replace(".", r"\.").replace("*", r"\d+")), v) for k, v in rules.items()
    ]
    plan = {}
    for name, module in model.named_modules():
        style = next((v for p, v in patterns if p.fullmatch(name)), None)
        if style is None:
            continue
        for param, _ in module.named_parameters(recurse=False):
            plan[f"{name}.{param}"] = style
        plan[name] = style
    return plan


def _mesh(s: Settings, tp: int) -> Any:
    if s.optimizer != "adamw":
        # zeroshard refuses it: Muon would orthogonalize each rank's piece of a matrix.
        raise Skipped("--optimizer muon needs whole matrices, which tensor parallelism splits")
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world % tp:
        raise Skipped(f"--tp {tp} does not divide the world of {world} ranks")
    return init_device_mesh(s.device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))


def split(model: nn.Module, mesh: Any) -> None:
    """Split `model` over `mesh["tp"]` in place (`Skipped` for a model without a plan)."""
    if isinstance(model, HFCausalLM):
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        apply_tensor_parallelism(model.model, mesh["tp"], hf_plan(model.model))
        return
    if not isinstance(model, llama.Llama):
        raise Skipped("--tp splits llama and hf-llama (gpt's fused qkv has no plan here)")
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh["tp"], llama_plan())


def setup_zs3tp(model: nn.Module, s: Settings) -> Stepper:
    """zeroshard stage 3 over dp, `model` split over tp: `initialize(device_mesh=)`."""
    mesh = _mesh(s, s.tp)
    split(model, mesh)
    return _zs3_on(mesh, model, s)


def setup_zs3m(model: nn.Module, s: Settings) -> Stepper:
    """zs3 through `initialize(device_mesh=)` on a (world, 1) mesh, `model` not split."""
    return _zs3_on(_mesh(s, 1), model, s)


def setup_zs3ctp(model: nn.Module, s: Settings) -> Stepper:
    """zs3tp compiled whole by zeroshard.compile (inductor): the pieces become DTensors in
    the graph, torch's tensor-parallel collectives captured with the gathers."""
    import zeroshard.compile as zc

    mesh = _mesh(s, s.tp)
    split(model, mesh)
    return _zs3_on(mesh, model, s, compiled=zc.compile)


def _zs3_on(
    mesh: Any, model: nn.Module, s: Settings, compiled: Callable[[nn.Module], Any] | None = None
) -> Stepper:
    import zeroshard.engine as zs

    config = {"stage": 3, "compute_dtype": dtype_name(s.dtype), **s.zs_config}
    zmodel, opt = zs.initialize(
        model, adamw(model.parameters(), s.device), config, device_mesh=mesh
    )
    runner = zmodel if compiled is None else compiled(zmodel)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        runner(x, y).backward()
        if s.clip > 0:
            opt.clip_grad_norm_(s.clip)
        opt.step()
        opt.zero_grad()

    return step


def setup_fsdp2tp(model: nn.Module, s: Settings) -> Stepper:
    """FSDP2 fully_shard per block and root over dp, `model` split over tp (torchtitan's
    FSDP x TP), bf16 parameters, fp32 reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if s.clip > 0:
        # torch's clip_grad_norm_ refuses parameters on meshes of different dims.
        raise Skipped("clipping FSDP2 x TP needs torchtitan's clip_grad_norm_")
    mesh = _mesh(s, s.tp)
    split(model, mesh)
    low = None if s.dtype == torch.float32 else s.dtype
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
    blocks: Any = model.blocks
    for block in blocks:
        fully_shard(block, mesh=mesh["dp"], mp_policy=policy)
    fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
    opt = adamw(model.parameters(), s.device)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step
