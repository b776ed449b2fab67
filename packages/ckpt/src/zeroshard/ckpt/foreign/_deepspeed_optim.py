"""A DeepSpeed ZeRO checkpoint's optimizer state, loss scale and step, by parameter name.

The weights come from `read_deepspeed_checkpoint` (the fp32 master partitions). The base
optimizer's state tensors (`exp_avg`, `exp_avg_sq`) lie exactly like those partitions:
ZeRO 1/2 keep one flat tensor per param group and rank, aligned with
`single_partition_of_fp32_groups` (followed by the group's padding on the last ranks);
ZeRO 3 one per group and rank shaped like `fp32_flat_groups`. So the same layout code
maps them to parameters. Files are read with the restricted unpickler, memory-mapped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from zeroshard.ckpt._spec import TensorSpec
from zeroshard.ckpt._writer import RangeSpec
from zeroshard.ckpt.foreign._deepspeed import (
    DeepSpeedCheckpoint,
    _numel,
    _Piece,
    _spec,
    _zero3_trainable,
    _zero12_trainable,
    read_deepspeed_checkpoint,
)
from zeroshard.ckpt.foreign._deepspeed_files import (
    DeepSpeedCheckpointError,
    find_files,
    load_model_states,
)
from zeroshard.ckpt.foreign._deepspeed_source import FlatSource, OpenFile
from zeroshard.ckpt.foreign._named_state import (
    LossScaleState,
    NamedParamGroup,
    NamedTrainingState,
)
from zeroshard.ckpt.foreign._unpickle import load_torch_file

# [Note: DeepSpeed's Muon momentum]
# DeepSpeed's Muon (`"optimizer": {"type": "Muon"}`, `MuonWithAuxAdam`) splits each param
# group in a Muon half (`use_muon`) and an Adam half; the Adam half's state lies like the
# fp32 partitions, as any Adam's. At ZeRO 1/2 Muon's `momentum_buffer` does not: Muon
# orthogonalizes whole matrices while a rank's gradient partition is filled, so each rank
# keeps the whole momentum of every parameter its partition touches (DeepSpeed's
# `get_partition_info`), end to end in parameter order, without the alignment padding; a
# matrix that straddles two partitions has its momentum on both ranks, the same values
# (its gradient is all-reduced to both). Each parameter's is read from the first rank that
# holds it.
MUON_MOMENTUM = "momentum_buffer"


def _base_state(optim: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """The wrapped torch optimizer's state_dict (`state`, `param_groups`) of one rank."""
    inner = optim.get("base_optimizer_state", optim.get("optimizer_state_dict"))
    if isinstance(inner, dict) and "state" in inner and "param_groups" in inner:
        return inner
    raise DeepSpeedCheckpointError(
        f"{path}: no base optimizer state_dict (an elastic checkpoint, or an optimizer "
        "DeepSpeed wraps differently): its optimizer state cannot be carried over"
    )


def _rank_states(
    base: Mapping[str, Any], partitions: Sequence[FlatSource], path: Path, file: OpenFile, rank: int
) -> dict[str, dict[int, FlatSource]]:
    """key -> param group -> its source, cut to the group's fp32 partition's length (Muon's
    momentum, laid out otherwise, is left to `_muon_momentum`)."""
    states: dict[str, dict[int, FlatSource]] = {}
    for g, part in enumerate(partitions):
        entry = base["state"].get(g, {})
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor) or value.numel() <= 1:
                continue
            if key == MUON_MOMENTUM and _is_muon(base, g):
                continue
            if value.numel() < part.numel:
                raise DeepSpeedCheckpointError(
                    f"{path}: optimizer state {key!r} of group {g} has {value.numel()} elements "
                    f"but its fp32 partition {part.numel}"
                )
            flat = value.reshape(-1)[: part.numel]
            label = f"{key} rank {rank} group {g}"
            states.setdefault(key, {})[g] = FlatSource(flat, file, label)
    return states


def _is_muon(base: Mapping[str, Any], group: int) -> bool:
    """Whether DeepSpeed's Muon (`MuonWithAuxAdam`) steps param group `group` with Muon."""
    return bool(base["param_groups"][group].get("use_muon", False))


def _muon_momentum(
    bases: Sequence[Mapping[str, Any]],
    sizes: Sequence[int],
    param_shapes: Sequence[Mapping[str, Any]],
    paddings: Sequence[Sequence[int]] | None,
    files: Sequence[OpenFile],
) -> dict[str, RangeSpec]:
    """DeepSpeed Muon's momentum at ZeRO 1/2, by parameter name ([Note: DeepSpeed's Muon
    momentum])."""
    specs: dict[str, RangeSpec] = {}
    for g, shapes in enumerate(param_shapes):
        if not _is_muon(bases[0], g):
            continue
        size, pads = sizes[g], None if paddings is None else list(paddings[g])
        for r, (base, file) in enumerate(zip(bases, files, strict=True)):
            momentum = base["state"].get(g, {}).get(MUON_MOMENTUM)
            if not isinstance(momentum, torch.Tensor):
                continue  # no step taken yet: the momentum starts afresh
            source = FlatSource(momentum.reshape(-1), file, f"{MUON_MOMENTUM} rank {r} group {g}")
            lo, hi = r * size, (r + 1) * size
            at = current = 0
            for i, (name, shape) in enumerate(shapes.items()):
                n = _numel(shape)
                # DeepSpeed's get_partition_info: the parameters the partition touches.
                if lo <= current < hi or current < lo < current + n:
                    if name not in specs:
                        pieces = [_Piece(source, at, 0, n)]
                        specs[name] = _as_range(_spec(name, shape, torch.float32, pieces))
                    at += n
                current += n + (pads[i] if pads is not None else 0)
            if at != source.numel:
                raise DeepSpeedCheckpointError(
                    f"{file.path}: Muon's momentum of group {g} has {source.numel} elements but "
                    f"the parameters its partition touches {at}"
                )
    return specs


def _scalars(base: Mapping[str, Any], group: int) -> dict[str, float]:
    entry = base["state"].get(group, {})
    out = {
        k: float(v.item() if isinstance(v, torch.Tensor) else v)
        for k, v in entry.items()
        if (isinstance(v, torch.Tensor) and v.numel() == 1) or isinstance(v, (int, float))
    }
    # DeepSpeed's own Adam kernels (FusedAdam, DeepSpeedCPUAdam) keep `step` in the group.
    saved = base["param_groups"][group]
    if "step" not in out and isinstance(saved.get("step"), (int, float)):
        out["step"] = float(saved["step"])
    return out


def _loss_scale(optim: Mapping[str, Any]) -> LossScaleState | None:
    scaler = optim.get("loss_scaler")
    if scaler is None or not optim.get("dynamic_loss_scale"):
        return None
    attrs = vars(scaler)
    window = int(attrs.get("scale_window", 1000))
    # DeepSpeed doubles the scale when (iteration - last overflow) is a multiple of the
    # window: after cur_iter steps that is (cur_iter - last_overflow_iter - 1) good steps.
    good = (int(attrs["cur_iter"]) - int(attrs["last_overflow_iter"]) - 1) % window
    return LossScaleState(scale=float(attrs["cur_scale"]), good_steps=good)


# DeepSpeed MoE's bookkeeping in a param group (`split_params_into_different_moe_groups_
# for_optimizer`: the group's name, and whether it holds experts), not hyperparameters.
_MOE_KEYS = ("name", "moe")


def _hyperparameters(base: Mapping[str, Any], group: int) -> dict[str, Any]:
    saved = base["param_groups"][group].items()
    return {k: v for k, v in saved if k not in ("params", "step", *_MOE_KEYS)}


def read_deepspeed_training_state(path: Path, tag: str | None = None) -> NamedTrainingState:
    """Read what resuming a DeepSpeed ZeRO 1/2/3 run needs: weights, optimizer state by
    parameter name, param groups, loss scale and step (nothing is read until used)."""
    ckpt = read_deepspeed_checkpoint(path, tag)
    files = find_files(ckpt.directory, ckpt.tag, ckpt.world_size, ckpt.stage)
    model0 = load_model_states(files.model_states[0])
    optim = [load_torch_file(p, mmap=True)["optimizer_state_dict"] for p in files.optim_states]
    opened = [OpenFile(p) for p in files.optim_states]
    key = "fp32_flat_groups" if ckpt.stage == 3 else "single_partition_of_fp32_groups"
    bases = [_base_state(o, p) for o, p in zip(optim, files.optim_states, strict=True)]
    per_rank = [
        _rank_states(b, [FlatSource(t, f, "fp32") for t in o[key]], p, f, r)
        for r, (b, o, p, f) in enumerate(zip(bases, optim, files.optim_states, opened, strict=True))
    ]
    param_shapes: list[Mapping[str, Any]] = model0["param_shapes"]
    paddings = optim[0].get("param_alignment_paddings")
    optimizer_state: dict[str, dict[str, RangeSpec]] = {}
    for state_key in per_rank[0]:
        specs: dict[str, TensorSpec] = {}
        # Every param group holds the key, but Muon's (DeepSpeed's Muon steps the others
        # with its Adam).
        held = [g for g in range(len(param_shapes)) if not _is_muon(bases[0], g)]
        if any(sorted(rank.get(state_key, {})) != held for rank in per_rank):
            where = files.optim_states[0].parent
            raise DeepSpeedCheckpointError(
                f"{where}: optimizer state {state_key!r} is missing in a group"
            )
        groups = [[rank[state_key][g] for g in held] for rank in per_rank]
        shapes = [param_shapes[g] for g in held]
        if ckpt.stage == 3:
            _zero3_trainable(groups, shapes, ckpt.world_size, specs)
        else:
            pads = None if paddings is None else [paddings[g] for g in held]
            _zero12_trainable(groups, shapes, pads, ckpt.world_size, specs, ckpt.experts)
        optimizer_state[state_key] = {n: _as_range(s) for n, s in specs.items()}
    if any(_is_muon(bases[0], g) for g in range(len(param_shapes))):
        if ckpt.experts:
            raise DeepSpeedCheckpointError(
                f"{ckpt.directory}: DeepSpeed's Muon beside MoE experts: its momentum's layout "
                "is read without experts only"
            )
        if ckpt.stage == 3:
            raise DeepSpeedCheckpointError(
                f"{ckpt.directory}: a checkpoint of DeepSpeed's Muon is read at ZeRO 1/2 only "
                "(where its momentum's layout is known: [Note: DeepSpeed's Muon momentum]); "
                "this one is ZeRO-3's"
            )
        sizes = [t.numel() for t in optim[0][key]]
        momentum = _muon_momentum(bases, sizes, param_shapes, paddings, opened)
        if momentum:
            optimizer_state[MUON_MOMENTUM] = momentum
    param_groups = tuple(
        NamedParamGroup(
            names=tuple(shapes),
            hyperparameters=_hyperparameters(bases[0], g),
            scalars=_scalars(bases[0], g),
        )
        for g, shapes in enumerate(param_shapes)
    )
    return NamedTrainingState(
        source=f"DeepSpeed ZeRO-{ckpt.stage} checkpoint {ckpt.directory} "
        f"(world size {ckpt.world_size}, deepspeed {ckpt.ds_version})",
        stage=ckpt.stage,
        world_size=ckpt.world_size,
        step=_global_step(ckpt, files.model_states[0]),
        masters=_masters(ckpt, model0, files.model_states[0]),
        aliases=dict(ckpt.aliases),
        buffers={s.name: _as_range(s) for s in ckpt.specs if s.name in ckpt.buffers},
        frozen=ckpt.frozen,
        param_groups=param_groups,
        optimizer_state=optimizer_state,
        loss_scale=_loss_scale(optim[0]),
        not_carried=_not_carried(model0),
        experts=ckpt.experts,
    )


def _as_range(spec: TensorSpec) -> RangeSpec:
    if not isinstance(spec, RangeSpec):
        raise TypeError(f"{spec.name}: expected a spec that reads ranges")
    return spec


def _masters(
    ckpt: DeepSpeedCheckpoint, model0: Mapping[str, Any], path: Path
) -> dict[str, RangeSpec]:
    masters = {s.name: _as_range(s) for s in ckpt.specs if s.name not in ckpt.buffers}
    if ckpt.stage == 3:
        return masters
    # ZeRO 1 stores no frozen_param_shapes (zero_to_fp32 leaves frozen parameters out):
    # its frozen parameters are whole in the module's state dict, in the compute dtype
    # they trained in, which is all DeepSpeed itself has of them.
    file = OpenFile(path)
    skip = set(masters) | set(ckpt.buffers) | set(ckpt.aliases) | set(model0["buffer_names"])
    for name, tensor in model0["module"].items():
        if name not in skip and isinstance(tensor, torch.Tensor):
            source = FlatSource(tensor, file, f"frozen {name!r}")
            pieces = [_Piece(source, 0, 0, source.numel)]
            masters[name] = _as_range(_spec(name, tensor.shape, tensor.dtype, pieces))
    return masters


def _global_step(ckpt: DeepSpeedCheckpoint, model0_path: Path) -> int:
    if ckpt.step is None:
        raise DeepSpeedCheckpointError(f"{model0_path}: no global_steps")
    return ckpt.step


def _not_carried(model0: Mapping[str, Any]) -> tuple[str, ...]:
    out = []
    if model0.get("lr_scheduler") is not None:
        out.append(
            "the learning-rate scheduler's state (lr_scheduler): restore your scheduler "
            "yourself, e.g. by stepping it to the checkpoint's step"
        )
    if model0.get("data_sampler") is not None:
        out.append("the data sampler's state (data_sampler)")
    return tuple(out)
