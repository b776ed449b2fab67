"""Evaluation without an optimizer: `zs.initialize(model, None, config)`.

At stages 1-3 (eager, and at stage 3 `zeroshard.compile`) the forward of an engine built
without an optimizer equals the plain model's (same seed) bit for bit, as do its
`state_dict`, `full_state_dict` and `gathered_parameters`; meta-device init gives the
weights an engine with an optimizer gets, and a tensor-parallel model (a device mesh)
evaluates as its unsplit reference, as does a block on a process group of its own. A
backward that reaches a parameter, and the calls that need the optimizer, raise an error
naming it, on every rank, and the engine still evaluates afterwards. A checkpoint a
training engine saved at 2 ranks loads into evaluation-only engines at another stage and
at 1 and 2 ranks and gives the trained model's outputs (as do its consolidated weights
through `load_safetensors`); a DeepSpeed checkpoint loads the weights a training engine
loads from it (DCP's: test_dcp_resume.py). A transformers Llama built from a config
evaluates at stage 3 as the plain model.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import zeroshard.engine as zs
from tests._dist import run_each, run_ranks, subtests
from tests.engine._models import global_batches, loss_fn, make_model, make_optimizer

DEEPSPEED = Path(__file__).resolve().parents[1] / "ckpt" / "fixtures" / "deepspeed"


def _config(stage: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {"stage": stage, "reduce_bucket_bytes": 1500}
    if stage == 3:
        cfg.update(min_unit_params=1, persistence_threshold=0)
    return cfg


def _tokens() -> torch.Tensor:
    return global_batches(1, 1, 1, 3)[0, 0, 0][..., :-1]


def _same(ours: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert ours.keys() == want.keys(), f"{what}: keys {set(ours) ^ set(want)}"
    for k, v in want.items():
        assert torch.equal(ours[k].cpu(), v.cpu()), f"{what}: {k} differs"


def _forward_case(stage: int, root: str) -> None:
    ref = make_model(11)
    model, opt = zs.initialize(make_model(11), None, _config(stage))
    assert opt is None and zs.engine_state(model).optimizer is None
    tokens = _tokens()
    with torch.no_grad():
        want = ref(tokens)
        assert torch.equal(model(tokens), want), f"stage {stage}: forward under no_grad"
    out = model(tokens)  # with autograd on: the forward runs, a backward is refused
    assert torch.equal(out.detach(), want), f"stage {stage}: forward"
    with pytest.raises(RuntimeError, match="initialized without an optimizer"):
        out.float().pow(2).mean().backward()
    assert all(p.grad is None for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(model(tokens), want), f"stage {stage}: forward after the refusal"
    _same(model.state_dict(), ref.state_dict(), f"stage {stage}: state_dict")
    full = zs.full_state_dict(model)
    _same({k: full[k] for k in ref.state_dict()}, ref.state_dict(), "full_state_dict")
    with zs.state_dict_on_rank0(model):
        on0 = model.state_dict()
    if dist.get_rank() == 0:
        _same(on0, ref.state_dict(), f"stage {stage}: state_dict_on_rank0")
    with zs.gathered_parameters(model):
        ours = {n: p.detach().clone() for n, p in model.named_parameters()}
    _same(ours, dict(ref.named_parameters()), f"stage {stage}: gathered_parameters")
    other = make_model(12)
    model.load_state_dict(other.state_dict())
    with torch.no_grad():
        assert torch.equal(model(tokens), other(tokens)), f"stage {stage}: load_state_dict"
    needs = {
        "save_checkpoint": lambda: zs.save_checkpoint(model, None, root, step=1),
        "full_optimizer_state": lambda: zs.full_optimizer_state(model, "l1.weight"),
        "full_grad": lambda: zs.full_grad(model, "l1.weight"),
        "grad_norms": lambda: zs.grad_norms(model),
        "Snapshots": lambda: zs.Snapshots(model, None, root=root),
    }
    for call, run in needs.items():
        with pytest.raises(ValueError, match=f"{call} needs the optimizer"):
            run()
    assert not Path(root, "step-1").exists()
    with pytest.raises(ValueError, match="offload_optimizer"):
        zs.initialize(make_model(11), None, {**_config(stage), "offload_optimizer": True})


def _normal(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters(recurse=False):
            p.normal_()


def _meta_and_compiled() -> None:
    """Stage 3 on the meta device: the weights an engine with an optimizer initializes;
    `zeroshard.compile` of it forwards as eager does, and refuses a backward too."""
    import zeroshard.compile as zc

    def built(optimizer: bool) -> torch.nn.Module:
        with torch.device("meta"):
            model = make_model(11)
        model.offset = torch.zeros(model.offset.shape)  # a buffer: materialized by the user
        opt = make_optimizer(model) if optimizer else None
        return zs.initialize(model, opt, _config(3), param_init=_normal, init_seed=5)[0]

    trained, evaluated = built(True), built(False)
    _same(zs.full_state_dict(evaluated), zs.full_state_dict(trained), "meta-device init")
    tokens = _tokens()
    compiled = zc.compile(evaluated, backend="aot_eager")
    with torch.no_grad():
        want = evaluated(tokens)
        assert torch.equal(compiled(tokens), want), "compiled forward"
    # The compiled graph's gradients would go to the masters: refused there.
    out = compiled(tokens)
    with pytest.raises(RuntimeError, match="initialized without an optimizer"):
        out.float().pow(2).mean().backward()
    with torch.no_grad():
        assert torch.equal(compiled(tokens), want), "compiled forward after the refusal"


def _llama_case() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=61,
        hidden_size=24,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    ref = LlamaForCausalLM(config)
    torch.manual_seed(0)
    model, _ = zs.initialize(LlamaForCausalLM(config), None, _config(3))
    tokens = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(input_ids=tokens).logits
        want = ref(input_ids=tokens).logits
    assert torch.equal(got, want), "Llama logits at stage 3"


def _tensor_parallel_case() -> None:
    """Under a device mesh (tp 2): the split model's forward and full weights."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests.engine import _tp

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    model, ref = _tp.split_model(mesh, sp=False, seed=3)
    model, _ = zs.initialize(model, None, _config(3), device_mesh=mesh)
    _same(zs.full_state_dict(model), ref.state_dict(), "tensor parallel: full_state_dict")
    tokens = _tp.batches(1, 1, 1)[0, 0, 0][..., :-1]
    with torch.no_grad():
        # The rowwise layers sum their pieces over tp: the reference's sums, reordered.
        torch.testing.assert_close(model(tokens), ref(tokens), rtol=1e-6, atol=1e-6)


def _process_groups_case() -> None:
    """A block on a process group of each rank alone (as experts are): the same forward."""
    from zeroshard.comm import Group

    alone = [Group(dist.new_group([r])) for r in range(dist.get_world_size())]
    ref = make_model(11)
    groups = {"blocks.0": alone[dist.get_rank()]}
    model, _ = zs.initialize(make_model(11), None, _config(3), process_groups=groups)
    tokens = _tokens()
    with torch.no_grad():
        assert torch.equal(model(tokens), ref(tokens)), "process_groups: forward"


def _train_and_save(root: str, stage: int) -> None:
    """A training engine at `stage` takes 2 steps and saves; rank 0 writes its weights."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(11)
    model, opt = zs.initialize(model, make_optimizer(model), _config(stage))
    batches = global_batches(2, 1, world, 2)
    for step in range(2):
        loss_fn(model, batches[step, 0, rank]).backward()
        opt.step()
        opt.zero_grad()
    zs.save_checkpoint(model, opt, Path(root, f"trained{stage}"), step=2)
    full = zs.full_state_dict(model)
    if rank == 0:
        save_file({k: v.clone() for k, v in full.items()}, Path(root, f"trained{stage}.st"))
    dist.barrier()


def _evaluate_trained(root: str, saved: int, stage: int) -> None:
    """The checkpoint saved at stage `saved` loads into an evaluation-only engine at
    `stage` and gives the trained model's outputs (and weights)."""
    weights = load_file(Path(root, f"trained{saved}.st"))
    ref = make_model(11)
    ref.load_state_dict({k: weights[k] for k in ref.state_dict()})
    model, _ = zs.initialize(make_model(12), None, _config(stage))  # other initial weights
    assert zs.load_checkpoint(model, None, Path(root, f"trained{saved}")) == 2
    tokens = _tokens()
    with torch.no_grad():
        assert torch.equal(model(tokens), ref(tokens)), f"{saved} -> {stage}: outputs"
    _same(model.state_dict(), ref.state_dict(), f"{saved} -> {stage}: weights")
    fresh, _ = zs.initialize(make_model(12), None, _config(stage))
    zs.load_safetensors(fresh, Path(root, f"trained{saved}.st"))
    with torch.no_grad():
        assert torch.equal(fresh(tokens), ref(tokens)), f"{saved} -> {stage}: safetensors"
    with pytest.raises(ValueError, match="pass the optimizer returned"):
        zs.load_checkpoint(model, make_optimizer(ref), Path(root, f"trained{saved}"))


def _deepspeed_weights(stage: int) -> None:
    """A DeepSpeed ZeRO checkpoint loads into an evaluation-only engine the weights it
    loads into a training engine."""
    import sys

    case = DEEPSPEED / "resume_stage2"
    sys.path.insert(0, str(DEEPSPEED))
    try:
        import make_fixtures
    finally:
        sys.path.remove(str(DEEPSPEED))
    (kind,) = [k for name, _, _, k in make_fixtures.RESUME_CASES if name == case.name]
    assert json.loads((case / "resume.json").read_text())["stage"] == 2
    trained = make_fixtures.MODELS[kind]()
    # The training engine needs the saved run's param groups; evaluation needs none.
    named = list(trained.named_parameters())
    groups = [[p for n, p in named if ("norm" in n) == norm] for norm in (False, True)]
    opt = torch.optim.AdamW([{"params": g} for g in groups], lr=1e-3)
    trained, opt = zs.initialize(trained, opt, _config(stage))
    zs.load_checkpoint(trained, opt, case)
    evaluated, _ = zs.initialize(make_fixtures.MODELS[kind](), None, _config(stage))
    assert zs.load_checkpoint(evaluated, None, case) == 2
    _same(zs.full_state_dict(evaluated), zs.full_state_dict(trained), "DeepSpeed's weights")


def _fabric_offload_case() -> None:
    """Fabric's `setup(model)` under an `..._offload` strategy evaluates (the engine it
    builds has no optimizer, so no offload)."""
    from lightning.fabric import Fabric

    import zeroshard.engine.lightning  # noqa: F401  (its strategies in Fabric's registry)

    fabric = Fabric(strategy="zeroshard_stage_3_offload", accelerator="cpu", devices=1)
    fabric.launch()
    ref = make_model(11)
    model = fabric.setup(make_model(11))
    tokens = _tokens()
    with torch.no_grad():
        assert torch.equal(model(tokens), ref(tokens)), "Fabric, offload strategy"
    assert zs.engine_state(model).config.offload.optimizer is False


def _at_two(root: str) -> None:
    run_each(subtests({"stage": [1, 2, 3], "root": [root]}), _forward_case)
    run_each([{}], _meta_and_compiled)
    run_each([{}], _llama_case)
    run_each([{}], _tensor_parallel_case)
    run_each([{}], _process_groups_case)
    for stage in (2, 3):
        _train_and_save(root, stage)
    run_each(
        [{"root": root, "saved": 2, "stage": 3}, {"root": root, "saved": 3, "stage": 1}],
        _evaluate_trained,
    )
    run_each([{"stage": 3}], _deepspeed_weights)


def _at_one(root: str, lightning: bool) -> None:
    run_each(subtests({"root": [root], "saved": [2, 3], "stage": [1, 3]}), _evaluate_trained)
    if lightning:
        run_each([{}], _fabric_offload_case)


def test_evaluation_without_an_optimizer(tmp_path: Path) -> None:
    run_ranks(_at_two, 2, str(tmp_path))
    run_ranks(_at_one, 1, str(tmp_path), importlib.util.find_spec("lightning") is not None)
