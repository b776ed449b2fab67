"""DeepSpeed MoE checkpoints (expert parallelism, `deepspeed.moe.layer.MoE`) at ZeRO 1/2.

An MoE layer of `num_experts` E over `ep_size` P ranks holds E / P experts on each rank,
under the same local names `<layer>.deepspeed_moe.experts.deepspeed_experts.{j}.<rest>`
(j < E / P): expert-parallel rank k's j-th is the layer's global expert k * E / P + j.
With ZeRO 1/2 the experts go to param groups of their own, partitioned over the expert
data-parallel group of W / P ranks (its `partition_count`), not over all W: with
DeepSpeed's default topology (expert before data: `use_data_before_expert_parallelism`
off) rank r is expert-parallel rank r % P, and ranks k, k + P, ... hold, in that order,
the partitions of rank k's experts (its *instance*). `param_shapes` lists rank 0's local
names, which are also its global ones. DeepSpeed writes each expert's weights, in the
compute dtype, to `layer_{L}_expert_{E}_mp_rank_00_model_states.pt` (L counts the MoE
layers in module order) under its global name; the fp32 masters and the optimizer state
come from the ZeRO partitions, as every other parameter's; the expert files are checked
to hold every expert with the names and shapes the partitions have.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from zeroshard.ckpt.foreign._deepspeed_files import (
    EXPERT_FILE_RE,
    DeepSpeedCheckpointError,
    MissingRankFileError,
)
from zeroshard.ckpt.foreign._unpickle import load_torch_file

_EXPERT = re.compile(r"^(.*)\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(.+)$")
# The ds_config switch of DeepSpeed's other expert topology (data before expert).
_DATA_FIRST = "use_data_before_expert_parallelism"


def _files(directory: Path) -> dict[tuple[int, int], Path]:
    """(MoE layer, global expert) -> its model states file."""
    out = {}
    for path in directory.glob("layer_*_expert_*_model_states.pt"):
        match = EXPERT_FILE_RE.match(path.name)
        if match is None or int(match.group(3)) != 0:
            raise DeepSpeedCheckpointError(
                f"{path}: an expert file of a model-parallel checkpoint (mp_rank > 0): not read"
            )
        out[(int(match.group(1)), int(match.group(2)))] = path
    return out


def expert_names(
    directory: Path,
    model0: Mapping[str, Any],
    partition_counts: Sequence[int],
    world_size: int,
) -> dict[str, tuple[str, ...]]:
    """Each expert parameter's local name (rank 0's) -> its global name on each
    expert-parallel rank, in rank order; empty for a checkpoint without MoE layers.

    `partition_counts` are the ZeRO param groups' (`partition_count`, rank 0's file).
    A missing expert file, or one whose names or shapes the partitions do not have, is an
    error naming it.
    """
    counts = model0.get("num_experts")
    if not counts:
        return {}
    config = model0.get("ds_config") or {}
    if isinstance(config, Mapping) and config.get(_DATA_FIRST):
        raise DeepSpeedCheckpointError(
            f"{directory}: saved with {_DATA_FIRST} (data before expert parallelism): which "
            "ranks hold which experts is not read for that topology"
        )
    files = _files(directory)
    loaded: dict[tuple[int, int], dict[str, Any]] = {}

    def expert_file(layer: int, expert: int) -> dict[str, Any]:
        if (layer, expert) not in files:
            name = f"layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt"
            raise MissingRankFileError(
                f"{directory}: missing {name} (MoE layer {layer} has {counts[layer]} experts)"
            )
        if (layer, expert) not in loaded:
            loaded[(layer, expert)] = load_torch_file(files[(layer, expert)], mmap=True)
        return loaded[(layer, expert)]

    # The module path of each MoE layer, from its first expert's file.
    layers = {}
    for layer in range(len(counts)):
        match = next((_EXPERT.match(k) for k in expert_file(layer, 0)), None)
        if match is None:
            raise DeepSpeedCheckpointError(
                f"{files[(layer, 0)]}: holds no DeepSpeed MoE expert parameter"
            )
        layers[match.group(1)] = layer
    out: dict[str, tuple[str, ...]] = {}
    for g, shapes in enumerate(model0["param_shapes"]):
        experts = {n: _EXPERT.match(n) for n in shapes}
        if not any(experts.values()):
            continue
        dense = [n for n, m in experts.items() if m is None]
        if dense:
            raise DeepSpeedCheckpointError(
                f"{directory}: param group {g} holds experts and {dense[:3]}: not a param group "
                "of DeepSpeed's MoE split (split_params_into_different_moe_groups_for_optimizer)"
            )
        edp = int(partition_counts[g])
        if edp < 1 or world_size % edp:
            raise DeepSpeedCheckpointError(
                f"{directory}: expert param group {g} is partitioned over {edp} ranks, which do "
                f"not divide the world size {world_size}"
            )
        ep = world_size // edp
        for name, shape in shapes.items():
            match = experts[name]
            assert match is not None
            prefix, local, rest = match.group(1), int(match.group(2)), match.group(3)
            if prefix not in layers:
                raise DeepSpeedCheckpointError(
                    f"{directory}: expert {name!r} is in no MoE layer's expert files"
                )
            layer = layers[prefix]
            if counts[layer] % ep or local >= counts[layer] // ep:
                raise DeepSpeedCheckpointError(
                    f"{directory}: {name!r}: MoE layer {layer} has {counts[layer]} experts, "
                    f"which {ep} expert-parallel ranks do not hold {local + 1} of each"
                )
            per_rank = counts[layer] // ep
            names = []
            for k in range(ep):
                expert = k * per_rank + local
                full = f"{prefix}.deepspeed_moe.experts.deepspeed_experts.{expert}.{rest}"
                saved = expert_file(layer, expert).get(full)
                if saved is None or tuple(saved.shape) != tuple(shape):
                    raise DeepSpeedCheckpointError(
                        f"{files[(layer, expert)]}: holds {full!r} "
                        f"{'not at all' if saved is None else f'of shape {tuple(saved.shape)}'}, "
                        f"the ZeRO partitions of shape {tuple(shape)}"
                    )
                names.append(full)
            out[name] = tuple(names)
    return out
