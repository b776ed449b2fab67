"""A PyTorch DCP checkpoint (FSDP2, torchtitan) read as a `NamedTrainingState`, to resume it.

[Note: a training state in DCP]
`dcp.save` flattens the nested state dict it is given into dotted names, and each job
nests differently, so the parts are found by their shape, not by fixed keys:

- Optimizer (`get_state_dict`'s): tensors `<O>state.<fqn>.<key>` (Adam's `exp_avg` and
  `exp_avg_sq` sharded like the parameter, `step` a 0-dim tensor per parameter) and
  values `<O>param_groups.<i>.<key>` (the plain layout, `params` listing group i's
  fqns) or `<O>param_groups.<fqn>.<key>` (`flatten_optimizer_state_dict`, torchtitan's).
  `<O>` is the one prefix both appear under: `optimizer.` (FSDP2 recipes, torchtitan),
  `optim.`, `app.optim.` (the DCP tutorial's `AppState`).
- Model: the tensors under the prefix the optimizer's fqns are found under (`model.`,
  `app.model.`, or none: torchtitan saves the model at the top level, beside its
  `lr_scheduler`, `dataloader` and `train_state` entries, which are not the model's).
  Without optimizer state: `model.` if every tensor is under it, else the top level.
  DCP does not say which tensors are buffers: the caller names them (`buffers`).
- Step: torchtitan's `train_state.step`, else a top-level `step` entry, else Adam's.

Param groups of the flattened layout are rebuilt from their parameters' values: the
parameters with equal hyperparameters and step form one group (a resume needs each of
its own groups to lie inside one of the checkpoint's, which this keeps). Everything is a
`RangeSpec` over the chunks on disk: nothing but a few small values is read here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch

from zeroshard.ckpt._errors import CheckpointError
from zeroshard.ckpt._names import canonical_name
from zeroshard.ckpt._writer import RangeSpec
from zeroshard.ckpt.foreign._dcp import DCP_METADATA, DcpCheckpoint
from zeroshard.ckpt.foreign._named_state import NamedParamGroup, NamedTrainingState

STATE, GROUPS = "state.", "param_groups."
# torchtitan's entries beside a model saved at the top level.
TITAN_ENTRIES = ("lr_scheduler", "dataloader", "train_state")
_STEP_DIR = re.compile(r"step-(\d+)")


def find_dcp_checkpoint(path: Path, tag: str | None = None, step: int | None = None) -> Path | None:
    """The DCP checkpoint `path` names: itself, or in a root of `step-N` checkpoints
    (torchtitan's) `tag`, `step-{step}` or the newest; None if there is none."""
    if (path / DCP_METADATA).is_file():
        return path if tag is None and step is None else None
    if tag is not None or step is not None:
        found = path / (tag if tag is not None else f"step-{step}")
        return found if (found / DCP_METADATA).is_file() else None
    steps = []
    if path.is_dir():
        for d in path.iterdir():
            match = _STEP_DIR.fullmatch(d.name)
            if match and (d / DCP_METADATA).is_file():
                steps.append((int(match.group(1)), d))
    return max(steps)[1] if steps else None


def is_dcp_checkpoint(
    path: str | os.PathLike[str], tag: str | None = None, step: int | None = None
) -> bool:
    """Whether `path` is a PyTorch DCP checkpoint, or a root of them (`step-N` folders,
    torchtitan's) holding one (`tag`, `step` or any)."""
    return find_dcp_checkpoint(Path(path), tag, step) is not None


def _optimizer_prefix(ckpt: DcpCheckpoint) -> str | None:
    """`<O>`: the one prefix of `param_groups.` entries that has `state.` entries too."""
    found = set()
    for key in (*ckpt.tensors, *ckpt.values):
        at = key.find(GROUPS)
        while at >= 0:
            if at == 0 or key[at - 1] == ".":
                found.add(key[:at])
            at = key.find(GROUPS, at + 1)
    prefixes = sorted(
        p for p in found if any(k.startswith(p + STATE) for k in (*ckpt.tensors, *ckpt.values))
    )
    if len(prefixes) > 1:
        raise CheckpointError(
            f"{ckpt.path}: optimizer state under several names {prefixes}: one optimizer is "
            "resumed (a torchtitan OptimizersContainer of one model part, or one "
            "get_state_dict)"
        )
    return prefixes[0] if prefixes else None


def _split(rest: str) -> tuple[str, str]:
    """`fqn.key` -> (fqn, key): fqns hold dots, keys (exp_avg, lr) do not."""
    fqn, _, key = rest.rpartition(".")
    return fqn, key


def _model_prefix(ckpt: DcpCheckpoint, opt: str | None, fqns: Collection[str]) -> str:
    tensors = {canonical_name(k): k for k in ckpt.tensors if opt is None or not k.startswith(opt)}
    if not fqns:
        return "model." if tensors and all(k.startswith("model.") for k in tensors) else ""
    first = next(iter(fqns))
    candidates = sorted(
        {k[: len(k) - len(first)] for k in tensors if k == first or k.endswith("." + first)},
        key=len,
    )
    for prefix in candidates:
        if all(prefix + f in tensors for f in fqns):
            return prefix
    raise CheckpointError(
        f"{ckpt.path}: the optimizer's parameters ({sorted(fqns)[:3]}...) are not among the "
        "checkpoint's tensors under one prefix: not a get_state_dict checkpoint"
    )


def _scalar(ckpt: DcpCheckpoint, key: str) -> float:
    if key not in ckpt.tensors:
        return float(ckpt.value(key))
    spec = ckpt.spec(key)
    if spec.numel != 1:
        raise CheckpointError(f"{ckpt.path}: {key!r} holds {spec.numel} elements, not a scalar")
    out = torch.empty(1, dtype=spec.dtype)
    spec.read(out)
    return float(out.item())


def _hyper_key(hyper: Mapping[str, Any], step: float | None) -> str:
    return repr((sorted(hyper.items()), step))


class _Optimizer:
    """The optimizer entries under prefix `opt`: per-fqn state specs, steps, groups."""

    def __init__(self, ckpt: DcpCheckpoint, opt: str) -> None:
        self.ckpt = ckpt
        self.state: dict[str, dict[str, str]] = {}  # canonical fqn -> {key: saved name}
        for key in (*ckpt.tensors, *ckpt.values):
            if key.startswith(opt + STATE):
                fqn, sk = _split(key[len(opt + STATE) :])
                self.state.setdefault(canonical_name(fqn), {})[sk] = key
        self.hyper: dict[str, dict[str, str]] = {}  # group label -> {key: saved name}
        for key in ckpt.values:
            if key.startswith(opt + GROUPS):
                label, hk = _split(key[len(opt + GROUPS) :])
                self.hyper.setdefault(label, {})[hk] = key
        # The plain layout names its groups 0, 1, ... and lists each one's `params`.
        self.plain = bool(self.hyper) and all(
            label.isdigit() and "params" in keys for label, keys in self.hyper.items()
        )

    def step_of(self, fqn: str) -> float | None:
        saved = self.state.get(fqn, {}).get("step")
        return None if saved is None else _scalar(self.ckpt, saved)

    def groups(self) -> list[tuple[list[str], dict[str, Any]]]:
        """(canonical fqns, hyperparameters) of each param group, in the saved order."""
        values = {
            label: {k: self.ckpt.value(name) for k, name in keys.items()}
            for label, keys in self.hyper.items()
        }
        if self.plain:
            out = []
            for label in sorted(values, key=int):
                hyper = dict(values[label])
                names = [canonical_name(str(n)) for n in hyper.pop("params")]
                out.append((names, hyper))
            return out
        by_key: dict[str, tuple[list[str], dict[str, Any]]] = {}
        for label, hyper in values.items():
            fqn = canonical_name(label)
            names, _ = by_key.setdefault(_hyper_key(hyper, self.step_of(fqn)), ([], hyper))
            names.append(fqn)
        return list(by_key.values())


def _param_groups(ckpt: DcpCheckpoint, optimizer: _Optimizer) -> list[NamedParamGroup]:
    out = []
    keys = {frozenset(k for k in s if k != "step") for s in optimizer.state.values()}
    if len(keys) > 1:
        raise CheckpointError(
            f"{ckpt.path}: parameters hold different optimizer state ({sorted(map(sorted, keys))}"
            "): one optimizer of one kind is resumed"
        )
    for names, hyper in optimizer.groups():
        missing = [n for n in names if n not in optimizer.state]
        if optimizer.state and missing:
            raise CheckpointError(
                f"{ckpt.path}: {missing[:3]} have no optimizer state where the others have: "
                "parameters the optimizer never stepped cannot be resumed with it"
            )
        steps = {n: optimizer.step_of(n) for n in names}
        if len(set(steps.values())) > 1:
            raise CheckpointError(
                f"{ckpt.path}: the parameters of one param group were stepped a different "
                f"number of times ({dict(list(steps.items())[:4])}): zeroshard keeps one "
                "step per param group"
            )
        step = next(iter(steps.values()), None)
        scalars = {} if step is None else {"step": step}
        out.append(NamedParamGroup(tuple(names), hyper, scalars))
    return out


def _training_step(ckpt: DcpCheckpoint, groups: list[NamedParamGroup]) -> int:
    for key in ("train_state.step", "step"):
        if key in ckpt.values or key in ckpt.tensors:
            return int(_scalar(ckpt, key))
    steps = [g.scalars["step"] for g in groups if "step" in g.scalars]
    return int(max(steps)) if steps else 0


def read_dcp_training_state(
    path: str | os.PathLike[str],
    *,
    tag: str | None = None,
    step: int | None = None,
    buffers: Collection[str] = (),
) -> NamedTrainingState:
    """A PyTorch DCP checkpoint's weights, optimizer state and step by parameter name.

    `path` is a DCP checkpoint (FSDP2's `dcp.save` of `get_state_dict`'s dicts, nested as
    the job chose) or a root of `step-N` ones (torchtitan's: `step` picks one, else the
    newest). DCP does not record which tensors are buffers: those named in `buffers` are
    read as buffers, every other model tensor as a parameter.
    """
    root = Path(path)
    found = find_dcp_checkpoint(root, tag, step)
    if found is None and (root / DCP_METADATA).is_file():
        raise CheckpointError(
            f"{root} is one DCP checkpoint: tag= and step= pick one in a root of them"
        )
    if found is None:
        which = "" if tag is None and step is None else f" ({tag or f'step-{step}'})"
        raise CheckpointError(f"{root}{which} is not a PyTorch DCP checkpoint (no {DCP_METADATA})")
    ckpt = DcpCheckpoint(found)
    opt = _optimizer_prefix(ckpt)
    optimizer = None if opt is None else _Optimizer(ckpt, opt)
    fqns = set() if optimizer is None else set(optimizer.state)
    groups = [] if optimizer is None else _param_groups(ckpt, optimizer)
    fqns |= {n for g in groups for n in g.names}
    prefix = _model_prefix(ckpt, opt, fqns)
    model: dict[str, RangeSpec] = {}
    saved_as: dict[str, str] = {}
    for key in ckpt.tensors:
        if not key.startswith(prefix) or (opt is not None and key.startswith(opt)):
            continue
        if not prefix and key.split(".", 1)[0] in TITAN_ENTRIES:
            continue
        name = canonical_name(key[len(prefix) :])
        if name in saved_as:
            raise CheckpointError(
                f"{found}: {saved_as[name]!r} and {key!r} are both {name!r} once "
                "torch.compile's _orig_mod is dropped"
            )
        saved_as[name] = key
        model[name] = ckpt.spec(key)
    optimizer_state: dict[str, dict[str, RangeSpec]] = {}
    for fqn, keys in ({} if optimizer is None else optimizer.state).items():
        for key, saved in keys.items():
            if key != "step":
                optimizer_state.setdefault(key, {})[fqn] = ckpt.spec(saved)
    trainable = {n for g in groups for n in g.names}
    return NamedTrainingState(
        source=f"{found} (PyTorch DCP)",
        stage=3,  # FSDP2 shards parameters, gradients and optimizer state: ZeRO-3's
        world_size=ckpt.ranks,
        step=_training_step(ckpt, groups),
        masters={n: s for n, s in model.items() if n not in buffers},
        aliases={},
        buffers={n: s for n, s in model.items() if n in buffers},
        frozen=frozenset(n for n in model if n not in buffers and n not in trainable),
        param_groups=tuple(groups),
        optimizer_state=optimizer_state,
        not_carried=_unread(ckpt, opt, set(saved_as.values())),
    )


def _unread(ckpt: DcpCheckpoint, opt: str | None, model: set[str]) -> tuple[str, ...]:
    """The entries left unread (a scheduler, a data loader), by top-level name, and the
    optimizer's state when there is none."""
    unread: dict[str, list[str]] = {}
    for key in sorted({*ckpt.tensors, *ckpt.values} - model - {"step", "train_state.step"}):
        if opt is None or not key.startswith(opt):
            top, _, rest = key.partition(".")
            unread.setdefault(top, []).append(rest)
    out = []
    for top, rest in unread.items():
        some = f" ({', '.join(rest[:3])}{', ...' if len(rest) > 3 else ''})" if rest[0] else ""
        out.append(f"{top!r}{some}: a DCP entry zeroshard does not read")
    if opt is None:
        out.append("optimizer state: none saved (a model-only checkpoint), it starts afresh")
    return tuple(out)
