"""Finding and loading the files of a DeepSpeed ZeRO checkpoint.

A DeepSpeed checkpoint is a directory `<root>/<tag>/` (the tag, e.g. `global_step100`,
named by `<root>/latest`) holding, for data-parallel world size W and no model
parallelism:

- `[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt` for r in 0..W-1: rank r's flat
  fp32 partitions (`single_partition_of_fp32_groups` for ZeRO 1/2, `fp32_flat_groups`
  for ZeRO 3), plus its optimizer state, which we never read;
- `mp_rank_00_model_states.pt` (ZeRO 1/2) or `zero_pp_rank_{r}_mp_rank_00_model_states.pt`
  for every r (ZeRO 3): parameter names and shapes per group, buffers, frozen parameters
  (whole for ZeRO 1/2, rank r's partition for ZeRO 3) and the shared (tied) parameters;
- with MoE layers, `layer_{L}_expert_{E}_mp_rank_00_model_states.pt`: each expert's
  weights (read by `_deepspeed_moe`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zeroshard.ckpt._errors import CheckpointError, MissingShardError
from zeroshard.ckpt._names import canonical_name
from zeroshard.ckpt.foreign._unpickle import load_torch_file

_OPTIM_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL_RE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
# An MoE layer's expert (`_deepspeed_moe`): layer, global expert, model-parallel rank.
EXPERT_FILE_RE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")


class DeepSpeedCheckpointError(CheckpointError):
    """A DeepSpeed checkpoint is incomplete, inconsistent or of a kind we cannot read."""


class MissingRankFileError(DeepSpeedCheckpointError, MissingShardError):
    """A rank's optimizer or model states file of a DeepSpeed checkpoint is not there."""


@dataclass(frozen=True)
class DeepSpeedFiles:
    """The files of one DeepSpeed checkpoint tag, each list indexed by data-parallel rank."""

    directory: Path
    tag: str
    optim_states: tuple[Path, ...]
    model_states: tuple[Path, ...]
    partitioned_model_states: bool


def _has_ds_files(directory: Path) -> bool:
    return directory.is_dir() and (
        any(directory.glob("*_optim_states.pt")) or any(directory.glob("*_model_states.pt"))
    )


def is_deepspeed_checkpoint(path: Path) -> bool:
    """Whether `path` is a DeepSpeed checkpoint tag directory, or its parent with `latest`."""
    path = Path(path)
    if _has_ds_files(path):
        return True
    latest = path / "latest"
    if not latest.is_file():
        return False
    try:
        tag = latest.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return False
    return bool(tag) and "/" not in tag and _has_ds_files(path / tag)


def resolve_tag_directory(path: Path, tag: str | None) -> tuple[Path, str]:
    """The tag directory of a checkpoint given its root (with `latest`) or the tag directory."""
    path = Path(path)
    if tag is not None:
        if _has_ds_files(path / tag):
            return path / tag, tag
        if path.name == tag and _has_ds_files(path):
            return path, tag
        raise DeepSpeedCheckpointError(f"{path}: no DeepSpeed checkpoint with tag {tag!r}")
    if _has_ds_files(path):
        return path, path.name
    latest = path / "latest"
    if not latest.is_file():
        raise DeepSpeedCheckpointError(
            f"{path}: not a DeepSpeed checkpoint: no *_optim_states.pt or *_model_states.pt "
            "files, and no 'latest' file naming a tag"
        )
    found = latest.read_text().strip()
    if not found or "/" in found or not _has_ds_files(path / found):
        raise DeepSpeedCheckpointError(
            f"{latest} names tag {found!r}, but {path / found} holds no DeepSpeed checkpoint"
        )
    return path / found, found


def _by_rank(paths: list[Path], pattern: re.Pattern[str], what: str) -> dict[int, Path]:
    ranks: dict[int, Path] = {}
    for p in paths:
        match = pattern.match(p.name)
        if match is None:
            raise DeepSpeedCheckpointError(
                f"{p}: unexpected {what} file name (expert- or pipeline-parallel checkpoints "
                "are not supported)"
            )
        if int(match.group(2)) != 0:
            raise DeepSpeedCheckpointError(
                f"{p}: model-parallel checkpoints (mp_rank > 0) are not supported"
            )
        rank = int(match.group(1) or 0)
        if rank in ranks:
            raise DeepSpeedCheckpointError(f"{p} and {ranks[rank]} are both rank {rank}")
        ranks[rank] = p
    return ranks


def _missing(directory: Path, world_size: int, have: dict[int, Path], example: str) -> None:
    missing = [r for r in range(world_size) if r not in have]
    extra = sorted(r for r in have if r >= world_size)
    if missing:
        names = ", ".join(example.format(rank=r) for r in missing)
        raise MissingRankFileError(
            f"{directory}: missing rank file(s) for a world size of {world_size}: {names}"
        )
    if extra:
        raise DeepSpeedCheckpointError(
            f"{directory}: files for ranks {extra} beyond the world size of {world_size} "
            "(an older checkpoint overwritten in place?)"
        )


def find_files(directory: Path, tag: str, world_size: int, stage: int) -> DeepSpeedFiles:
    """List and check the rank files of a tag directory for `world_size` ranks at `stage`."""
    optim = _by_rank(sorted(directory.glob("*_optim_states.pt")), _OPTIM_RE, "optimizer")
    prefix = "bf16_" if any(p.name.startswith("bf16_") for p in optim.values()) else ""
    _missing(
        directory, world_size, optim, prefix + "zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    )
    found = directory.glob("*_model_states.pt")
    models = _by_rank(
        sorted(p for p in found if not EXPERT_FILE_RE.match(p.name)), _MODEL_RE, "model"
    )
    if stage == 3:
        _missing(directory, world_size, models, "zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
        model_paths = tuple(models[r] for r in range(world_size))
    else:
        single = directory / "mp_rank_00_model_states.pt"
        if not single.is_file():
            raise MissingRankFileError(f"{directory}: missing {single.name}")
        model_paths = (single,)
    return DeepSpeedFiles(
        directory=directory,
        tag=tag,
        optim_states=tuple(optim[r] for r in range(world_size)),
        model_states=model_paths,
        partitioned_model_states=stage == 3,
    )


def first_model_states(directory: Path) -> Path:
    """The model states file that holds the names and shapes (rank 0's)."""
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if (directory / name).is_file():
            return directory / name
    raise MissingRankFileError(
        f"{directory}: missing the model states file (mp_rank_00_model_states.pt for ZeRO 1/2, "
        "zero_pp_rank_0_mp_rank_00_model_states.pt for ZeRO 3)"
    )


def load_model_states(path: Path) -> dict[str, Any]:
    """Load a model states file (memory-mapped, safe) and check it is one."""
    state = load_torch_file(path, mmap=True)
    if not isinstance(state, dict) or "buffer_names" not in state or "module" not in state:
        raise DeepSpeedCheckpointError(f"{path} is not a DeepSpeed model states file")
    if state.get("param_shapes") is None:
        raise DeepSpeedCheckpointError(
            f"{path} has no param_shapes: not a ZeRO checkpoint (saved without a ZeRO optimizer)"
        )
    return _canonical_names(state)


def _canonical_names(state: dict[str, Any]) -> dict[str, Any]:
    """The model states under the names the model's code spells (ckpt's `_names`): a
    model compiled before `deepspeed.initialize` saved every name under `_orig_mod.`."""
    for key in ("module", "frozen_param_shapes", "frozen_param_fragments"):
        if state.get(key):
            state[key] = _renamed(state[key])
    state["param_shapes"] = [_renamed(group) for group in state["param_shapes"]]
    state["buffer_names"] = [canonical_name(n) for n in state["buffer_names"]]
    if state.get("shared_params"):
        shared = state["shared_params"].items()
        state["shared_params"] = {canonical_name(k): canonical_name(v) for k, v in shared}
    return state


def _renamed(named: Mapping[str, Any]) -> dict[str, Any]:
    """`named` under canonical names, in its order (param_shapes' order is the layout's)."""
    return {canonical_name(k): v for k, v in named.items()}


def load_optim_states(path: Path) -> dict[str, Any]:
    """Load a rank's optimizer states file (memory-mapped, safe); return its ZeRO state dict."""
    state = load_torch_file(path, mmap=True)
    inner = state.get("optimizer_state_dict") if isinstance(state, dict) else None
    if not isinstance(inner, dict) or "zero_stage" not in inner:
        raise DeepSpeedCheckpointError(f"{path} is not a DeepSpeed ZeRO optimizer states file")
    # The Adam moments (or whatever the optimizer keeps) are not part of the output: drop
    # our references so their mapped pages are never touched.
    inner.pop("base_optimizer_state", None)
    inner.pop("optimizer_state_dict", None)
    return inner
