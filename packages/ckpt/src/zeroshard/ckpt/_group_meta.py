"""`GroupMeta` (one flat group of a checkpoint, with its `TensorSplit` under tensor
parallelism), `ParamState` (a parameter's optimizer state kept whole) and `FileMeta` (a
rank file's size and checksum): the parts of `CheckpointMeta`, as frozen dataclasses."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from zeroshard.ckpt._errors import CheckpointError
from zeroshard.ckpt._keys import CHECKSUM_ALGORITHM, MASTER, OPTIM_PREFIX, PARAM
from zeroshard.partition import FlatLayout, Slot, dtype_from_name, dtype_name


def check_json(what: str, value: Any) -> None:
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{what} must hold only JSON values: {e}") from None


@dataclass(frozen=True)
class FileMeta:
    """Size and checksum of one file of a checkpoint."""

    size: int
    digest: str
    algorithm: str = CHECKSUM_ALGORITHM


@dataclass(frozen=True)
class TensorSplit:
    """How the instances of a group make one model under tensor parallelism.

    Instance k is tensor-parallel rank k. A slot named in `dims` holds piece k of its
    full tensor, cut into `instances` equal pieces along dim `dims[name]` (its slot shape
    is the piece's); every other slot holds the same values on every instance.

    As a group's `expert_split` (experts, groups of their own, under tensor parallelism),
    `ranks` is the tensor-parallel size: the instances come in runs of `ranks`, run e
    expert e's tensor-parallel ranks in order, each cut as above into `ranks` pieces.
    """

    dims: Mapping[str, int] = field(default_factory=dict)
    ranks: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dims", {str(k): int(v) for k, v in self.dims.items()})
        object.__setattr__(self, "ranks", int(self.ranks))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {"dims": dict(self.dims), **({"ranks": self.ranks} if self.ranks else {})}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> TensorSplit:
        """Read `to_dict()` output."""
        return TensorSplit({str(k): int(v) for k, v in d["dims"].items()}, int(d.get("ranks", 0)))


@dataclass(frozen=True)
class GroupMeta:
    """One flat parameter group: its layout and what each rank stores of it.

    `shards` maps each stored kind (`master`, `param`, `optim.{state}`) to its dtype;
    every rank file that holds the group (`holds`) has one `(layout.shard_numel,)` tensor
    per kind. The parameter
    values are read from `master` when present, else from `param`. A group with
    `requires_grad=False` holds frozen parameters (`param_group` is then usually None).
    `scalars` are per-group optimizer state scalars such as Adam's `step`.

    `rank_sets` is None for a group sharded over the checkpoint's whole world (rank file
    r holds shard r). A group sharded over a process group of its own (experts under
    expert parallelism) holds different values on different sets of ranks: one tuple per
    such set (an *instance*, ordered by its first rank), listing the rank files that hold
    its shards 0, 1, ... (`layout.world_size` of them). The sets may leave rank files
    out (format version 7): a group on the first replica's ranks alone, under hybrid
    sharding beside groups of their own that cross the replicas, is one set of those
    ranks, and the other ranks' files do not hold it.

    `tensor_split` (tensor parallelism) says that the instances are the tensor-parallel
    ranks of one model, and which slots are pieces of a bigger tensor (see `TensorSplit`):
    a full state dict then holds one tensor per name, made from every instance.
    `expert_split` (a group of its own under tensor parallelism: experts) says how its
    instances, each expert's tensor-parallel ranks, cut each expert (`TensorSplit.ranks`):
    consolidation joins an expert's pieces, and a load at another tensor-parallel size
    recuts them, as for `tensor_split` within each expert's run of instances.
    """

    name: str
    layout: FlatLayout
    shards: Mapping[str, torch.dtype]
    param_group: int | None = 0
    requires_grad: bool = True
    scalars: Mapping[str, Any] = field(default_factory=dict)
    rank_sets: tuple[tuple[int, ...], ...] | None = None
    tensor_split: TensorSplit | None = None
    expert_split: TensorSplit | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise CheckpointError("a group needs a non-empty name")
        if not self.shards:
            raise CheckpointError(f"group {self.name!r} stores no shards")
        for kind, dtype in self.shards.items():
            if kind not in (MASTER, PARAM) and not (
                kind.startswith(OPTIM_PREFIX) and len(kind) > len(OPTIM_PREFIX)
            ):
                raise CheckpointError(
                    f"group {self.name!r}: shard kind {kind!r} is not 'master', 'param' "
                    "or 'optim.<state>'"
                )
            if not isinstance(dtype, torch.dtype):
                raise CheckpointError(f"group {self.name!r}: dtype of {kind!r} is {dtype!r}")
        if MASTER not in self.shards and PARAM not in self.shards:
            raise CheckpointError(f"group {self.name!r} stores neither 'master' nor 'param'")
        check_json(f"group {self.name!r} scalars", dict(self.scalars))
        object.__setattr__(self, "shards", dict(self.shards))
        object.__setattr__(self, "scalars", dict(self.scalars))
        if self.rank_sets is not None:
            sets = tuple(tuple(int(r) for r in s) for s in self.rank_sets)
            object.__setattr__(self, "rank_sets", sets)
            flat = [r for s in sets for r in s]
            if not sets or any(len(s) != self.layout.world_size for s in sets):
                raise CheckpointError(
                    f"group {self.name!r}: every rank set must list {self.layout.world_size} "
                    f"ranks (the layout's world size), got {list(sets)}"
                )
            if len(set(flat)) != len(flat) or min(flat) < 0:
                raise CheckpointError(
                    f"group {self.name!r}: rank sets overlap or name a negative rank: {list(sets)}"
                )
            if [s[0] for s in sets] != sorted(s[0] for s in sets):
                raise CheckpointError(f"group {self.name!r}: rank sets not ordered by first rank")
        if self.tensor_split is not None:
            self._check_split(self.tensor_split)
        if self.expert_split is not None:
            self._check_split(self.expert_split)
            ranks = self.expert_split.ranks
            if ranks < 1 or self.instances % ranks:
                raise CheckpointError(
                    f"group {self.name!r}: expert_split's {ranks} tensor-parallel ranks do not "
                    f"divide its {self.instances} instances"
                )

    def _check_split(self, split: TensorSplit) -> None:
        shapes = {s.name: s.shape for s in self.layout.slots}
        for name, dim in split.dims.items():
            if name not in shapes:
                raise CheckpointError(f"group {self.name!r}: tensor_split names unknown {name!r}")
            if not 0 <= dim < len(shapes[name]):
                raise CheckpointError(
                    f"group {self.name!r}: {name!r} of shape {shapes[name]} cannot be split "
                    f"along dim {dim}"
                )

    @property
    def instances(self) -> int:
        """How many different sets of values the group has (1 unless on its own group)."""
        return 1 if self.rank_sets is None else len(self.rank_sets)

    def holds(self, rank: int) -> bool:
        """Whether rank file `rank` holds this group's shards."""
        return self.rank_sets is None or any(rank in s for s in self.rank_sets)

    def file_rank(self, instance: int, shard: int) -> int:
        """The rank file holding shard `shard` of instance `instance`."""
        if not 0 <= instance < self.instances:
            raise CheckpointError(
                f"group {self.name!r} has {self.instances} instance(s), not instance {instance}"
            )
        return shard if self.rank_sets is None else self.rank_sets[instance][shard]

    @property
    def pieces(self) -> int:
        """How many pieces a split slot is cut into: one per instance (`tensor_split`), one
        per tensor-parallel rank of an expert (`expert_split`); 1 without a split."""
        if self.expert_split is not None:
            return self.expert_split.ranks
        return 1 if self.tensor_split is None else self.instances

    @property
    def experts(self) -> int:
        """How many of the instances hold different values (experts): a tensor-parallel
        group's instances are one model, an expert's tensor-parallel ranks one expert."""
        return self.instances // self.pieces

    def split_dim(self, name: str) -> int | None:
        """The dim slot `name` is split along over the instances (tensor parallelism; an
        expert's run of them under `expert_split`), or None when each holds it whole."""
        split = self.tensor_split if self.expert_split is None else self.expert_split
        return None if split is None else split.dims.get(name)

    def full_shape(self, slot: Slot) -> tuple[int, ...]:
        """The shape of the whole tensor of `slot` (its pieces joined, when split; an
        expert's whole tensor under `expert_split`)."""
        dim = self.split_dim(slot.name)
        if dim is None:
            return slot.shape
        return tuple(n * self.pieces if d == dim else n for d, n in enumerate(slot.shape))

    @property
    def value_kind(self) -> str:
        """The kind the parameter values are read from: 'master' if stored, else 'param'."""
        return MASTER if MASTER in self.shards else PARAM

    @property
    def optim_states(self) -> tuple[str, ...]:
        """Names of the optimizer state tensors stored (e.g. 'exp_avg', 'exp_avg_sq')."""
        return tuple(k[len(OPTIM_PREFIX) :] for k in self.shards if k.startswith(OPTIM_PREFIX))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "name": self.name,
            "layout": self.layout.to_dict(),
            "param_group": self.param_group,
            "requires_grad": self.requires_grad,
            "shards": {k: dtype_name(d) for k, d in self.shards.items()},
            "scalars": dict(self.scalars),
            **({} if self.rank_sets is None else {"rank_sets": [list(s) for s in self.rank_sets]}),
            **({} if self.tensor_split is None else {"tensor_split": self.tensor_split.to_dict()}),
            **({} if self.expert_split is None else {"expert_split": self.expert_split.to_dict()}),
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> GroupMeta:
        """Read `to_dict()` output."""
        pg = d["param_group"]
        sets = d.get("rank_sets")
        split = d.get("tensor_split")
        experts = d.get("expert_split")
        return GroupMeta(
            name=str(d["name"]),
            layout=FlatLayout.from_dict(dict(d["layout"])),
            shards={str(k): dtype_from_name(str(v)) for k, v in d["shards"].items()},
            param_group=None if pg is None else int(pg),
            requires_grad=bool(d["requires_grad"]),
            scalars=dict(d.get("scalars", {})),
            rank_sets=None if sets is None else tuple(tuple(s) for s in sets),
            tensor_split=None if split is None else TensorSplit.from_dict(split),
            expert_split=None if experts is None else TensorSplit.from_dict(experts),
        )


def check_experts_marked(groups: Sequence[GroupMeta]) -> None:
    """CheckpointError where experts of a tensor-parallel checkpoint were saved before
    `expert_split` was recorded (the same format version): which instances are one
    expert's pieces, and which slots are pieces, is not known."""
    if all(g.tensor_split is None for g in groups):
        return
    unmarked = [
        g.name
        for g in groups
        if g.instances > 1 and g.tensor_split is None and g.expert_split is None
    ]
    if unmarked:
        raise CheckpointError(
            f"groups {unmarked} hold experts under tensor parallelism without expert_split "
            "(an older checkpoint): which instances are one expert's pieces is not "
            "recorded; load it with the build that saved it, at the layout it was saved "
            "at, and save it again"
        )


@dataclass(frozen=True)
class ParamState:
    """One parameter's optimizer state kept whole (version 4): its tensors, stored in rank
    file `rank` under `param_state_key(param, state)`, each with its dtype, shape and
    whether it lived on the device (else on the host, as torch keeps Adam's `step`); and
    its scalars (JSON values)."""

    rank: int
    tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...], bool]] = field(default_factory=dict)
    scalars: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "tensors",
            {
                str(k): (d, tuple(int(x) for x in shape), bool(dev))
                for k, (d, shape, dev) in self.tensors.items()
            },
        )
        object.__setattr__(self, "scalars", dict(self.scalars))
        check_json("param state scalars", self.scalars)
        for key, (dtype, _, _) in self.tensors.items():
            if not isinstance(dtype, torch.dtype):
                raise CheckpointError(f"param state {key!r}: dtype {dtype!r}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "rank": self.rank,
            "tensors": {
                k: [dtype_name(d), list(shape), on_device]
                for k, (d, shape, on_device) in self.tensors.items()
            },
            "scalars": dict(self.scalars),
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> ParamState:
        """Read `to_dict()` output."""
        return ParamState(
            rank=int(d["rank"]),
            tensors={
                str(k): (dtype_from_name(str(t[0])), tuple(int(x) for x in t[1]), bool(t[2]))
                for k, t in d["tensors"].items()
            },
            scalars=dict(d.get("scalars", {})),
        )
