"""DTensor parameters in flat groups: their local tensors, their gradients, their pieces.

[Note: DTensor parameters]
torch's tensor parallelism (`parallelize_module` over a device mesh's `tp` dim) makes a
layer's parameters DTensors: each rank holds a local tensor (its piece of a `Shard(d)`
parameter, or a whole copy of a `Replicate()` one) and the placement says how the pieces
make the full tensor. The engine flattens and shards each rank's LOCAL tensor over the
mesh's data-parallel ranks, as it does a plain parameter: the parameter stays the same
DTensor object, only its local tensor's `.data` becomes the view of the flat buffer
(`data_of`), so the module computes with DTensors and torch's tensor-parallel
collectives run as they would without the engine.

A DTensor parameter's gradient is a DTensor too. For a replicated parameter inside a
sequence-parallel region (a norm whose input is split along the sequence) it is
`Partial`: each tensor-parallel rank holds the sum over its own part of the sequence.
`local_grad` redistributes it to the parameter's own placement (an all-reduce over tp, as
FSDP2 does) before its local tensor is reduced over the data-parallel ranks; a gradient
already in the parameter's placement is taken as it is.

Plain parameters of a tensor-parallel model (a norm outside sequence parallelism) see
the same input on every tensor-parallel rank, so they and their gradients are the same
there: replicated over tp, like a `Replicate()` DTensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from zeroshard.ckpt import canonical_name
from zeroshard.comm import Group
from zeroshard.partition import DEFAULT_GROUP_LABEL, FlatLayout

if TYPE_CHECKING:
    from zeroshard.engine.runtime._flat_group import FlatParamGroup

# The `GroupKey.process_group` label of the parameters split over tp: they get flat groups
# of their own, whose gradient norms count once per tensor-parallel rank (each holds
# other elements), where the replicated ones count once in all. Those of a module on a
# process group of its own (experts) are labelled `split_label(path)`.
SPLIT_LABEL = "tensor-parallel"
_SPLIT_SUFFIX = "/" + SPLIT_LABEL


def split_label(path: str) -> str:
    """The label of the split parameters of module `path`, on a process group of its own
    (a module path has no '/')."""
    return path + _SPLIT_SUFFIX


def group_label(name: str, split: bool, own: Iterable[str]) -> str:
    """The `GroupKey.process_group` label of parameter `name`: the longest module path of
    `own` (modules on process groups of their own) that holds it, else 'default'; marked
    when the parameter is `split` over tp."""
    best = DEFAULT_GROUP_LABEL
    for path in own:
        inside = name.startswith(canonical_name(path) + ".")
        if inside and (best == DEFAULT_GROUP_LABEL or len(path) > len(best)):
            best = path
    if not split:
        return best
    return SPLIT_LABEL if best == DEFAULT_GROUP_LABEL else split_label(best)


def own_path(label: str) -> str | None:
    """The module path whose process group of its own a flat group of `GroupKey.process_group`
    `label` is on (its pieces under tp too); None on the shard group (or the mesh's dp)."""
    if label in (DEFAULT_GROUP_LABEL, SPLIT_LABEL):
        return None
    return label.removesuffix(_SPLIT_SUFFIX)


def is_dtensor(t: torch.Tensor | None) -> bool:
    """Whether `t` is a DTensor."""
    return isinstance(t, DTensor)


def data_of(p: torch.Tensor) -> torch.Tensor:
    """The tensor whose `.data` holds `p`'s values on this rank: a DTensor's local
    tensor, or `p` itself. The flat group points it at its view of the flat buffer."""
    return p._local_tensor if isinstance(p, DTensor) else p


def point_at(p: torch.Tensor, view: torch.Tensor) -> None:
    """Make `view` hold `p`'s values on this rank (its `.data`, or a DTensor's local
    tensor's). A DTensor's own dtype is fixed when it is made, so the first view in
    another dtype (the compute dtype) re-makes its metadata in that dtype once."""
    if not isinstance(p, DTensor):
        p.data = view
        return
    if p.dtype != view.dtype:
        typed = DTensor.from_local(
            torch.empty(local_shape(p), dtype=view.dtype, device=view.device),
            p.device_mesh,
            p.placements,
            run_check=False,
            shape=p.shape,
            stride=p.stride(),
        )
        p.data = typed
        p._local_tensor = typed._local_tensor
        p._spec = typed._spec
    p._local_tensor.data = view


def local_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The shape of this rank's part of `p` (a DTensor's local shape)."""
    return tuple(data_of(p).shape)


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """`p.grad` as this rank's local tensor, in `p`'s own placement (see [Note: DTensor
    parameters]: a `Partial` gradient is all-reduced over tp first)."""
    grad = p.grad
    if isinstance(grad, DTensor) and isinstance(p, DTensor):
        if grad.placements != p.placements:
            grad = grad.redistribute(p.device_mesh, p.placements)
        return grad._local_tensor
    return grad


def like_param(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (this rank's values of `p`, or of its gradient) as `p` holds them: a
    DTensor of its mesh, placement and shape when `p` is one, else `local` itself (as
    `p.grad`, autograd accumulates into it in place)."""
    if not isinstance(p, DTensor):
        return local
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def local_piece(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of `value`, a value for parameter `p`: a DTensor's local tensor
    (in `p`'s placement), or for a DTensor `p` a plain tensor of its full shape cut to
    this rank's piece; None when `value` does not have `p`'s full shape."""
    if isinstance(value, DTensor):
        if isinstance(p, DTensor) and value.placements != p.placements:
            value = value.redistribute(p.device_mesh, p.placements)
        value = value.to_local() if isinstance(p, DTensor) else value.full_tensor()
        return value
    if not isinstance(p, DTensor):
        return value
    if tuple(value.shape) != tuple(p.shape):
        return None
    dim = split_dim(p)
    if dim is None:
        return value
    size = p.device_mesh.size()
    n = p.shape[dim] // size
    return value.narrow(dim, p.device_mesh.get_local_rank() * n, n)


def full_runs(
    p: torch.Tensor, shape: Sequence[int], start: int, numel: int
) -> Iterator[tuple[int, int, int]]:
    """Local elements [start, start + numel) of `p`'s piece (of shape `shape`, its slot's)
    as runs of its full tensor's flattened elements: (full start, local start, length)
    for each run (one for a parameter not split)."""
    dim = split_dim(p)
    if dim is None:
        yield start, start, numel
        return
    assert isinstance(p, DTensor)
    parts, piece = p.device_mesh.size(), p.device_mesh.get_local_rank()
    # Each index before `dim` holds one contiguous run of the piece: its extent along dim
    # times everything after it.
    inner = math.prod(shape[dim:])
    at, end = start, start + numel
    while at < end:
        outer, within = divmod(at, inner)
        n = min(inner - within, end - at)
        yield (outer * parts + piece) * inner + within, at, n
        at += n


def split_dim(p: torch.Tensor) -> int | None:
    """The dim a DTensor parameter is split along over its (1-D) mesh; None when each rank
    holds the whole tensor (replicated, or a plain parameter)."""
    if not isinstance(p, DTensor):
        return None
    (placement,) = p.placements
    if isinstance(placement, Shard):
        return placement.dim if placement.dim >= 0 else placement.dim + p.dim()
    return None


def placement_problem(name: str, p: nn.Parameter, mesh: DeviceMesh) -> str | None:
    """Why DTensor parameter `name` cannot be sharded over the data-parallel ranks of a
    mesh whose tensor-parallel dim is `mesh`; None when it can."""
    assert isinstance(p, DTensor)
    if p.device_mesh != mesh:
        return (
            f"parameter {name!r} is a DTensor on mesh {p.device_mesh}, not on the device "
            f"mesh's 'tp' dim {mesh}: parallelize the model over device_mesh['tp']"
        )
    (placement,) = p.placements
    if type(placement) is Shard:
        size = mesh.size()
        dim = split_dim(p)
        assert dim is not None
        if p.shape[dim] % size:
            return (
                f"parameter {name!r} of shape {tuple(p.shape)} is split along dim {dim} over "
                f"tp {size}, which does not divide {p.shape[dim]}: zeroshard needs even "
                "pieces (pad the layer or pick a tp size that divides it)"
            )
        return None
    if type(placement) is Replicate:
        return None
    return (
        f"parameter {name!r} has placement {placement}: zeroshard takes Shard(d) and "
        "Replicate() DTensor parameters (ColwiseParallel, RowwiseParallel, SequenceParallel)"
    )


@dataclass(frozen=True)
class TensorParallel:
    """The tensor-parallel dim of `initialize`'s device mesh, as the runtime sees it:
    `mesh` (1-D) and its process `group`."""

    mesh: DeviceMesh
    group: Group

    @property
    def size(self) -> int:
        """Ranks a split parameter is cut over."""
        return self.group.size

    @staticmethod
    def is_split_group(label: str) -> bool:
        """Whether the flat group of `GroupKey.process_group` `label` holds pieces of
        split parameters (else parameters replicated over tp)."""
        return label == SPLIT_LABEL or label.endswith(_SPLIT_SUFFIX)

    def full_values(
        self, buffer: torch.Tensor, layout: FlatLayout, params: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """The full tensor of each of `params` (a split flat group's parameters, `layout`'s
        slots) from `buffer`, this rank's whole flat buffer of their local tensors: one
        all-gather of it over tp, then each slot's pieces joined along its dim
        (collective over tp)."""
        gathered = torch.empty(self.size * buffer.numel(), dtype=buffer.dtype, device=buffer.device)
        self.group.all_gather_into(
            gathered, buffer, label="full tensors of split parameters"
        ).wait()
        pieces = gathered.view(self.size, buffer.numel())
        out = []
        for p, slot in zip(params, layout.slots, strict=True):
            parts = [pieces[k, slot.offset : slot.end].view(slot.shape) for k in range(self.size)]
            dim = split_dim(p)
            out.append(parts[0].clone() if dim is None else torch.cat(parts, dim))
        return out

    def whole_tensors(
        self, pieces: Sequence[torch.Tensor], dims: Sequence[int]
    ) -> list[torch.Tensor]:
        """Each of `pieces` (this rank's piece of a tensor split along `dims[i]`, the same
        shapes on every tensor-parallel rank) joined whole: one all-gather over tp
        (collective over tp)."""
        flat = torch.cat([p.reshape(-1) for p in pieces])
        gathered = torch.empty(self.size * flat.numel(), dtype=flat.dtype, device=flat.device)
        self.group.all_gather_into(gathered, flat, label="whole tensors of split pieces").wait()
        rows = gathered.view(self.size, flat.numel())
        out, at = [], 0
        for piece, dim in zip(pieces, dims, strict=True):
            n = piece.numel()
            out.append(
                torch.cat([rows[k, at : at + n].view(piece.shape) for k in range(self.size)], dim)
            )
            at += n
        return out

    def own_piece(self, whole: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's piece of `whole`, a tensor split evenly along `dim` (a view)."""
        n = whole.shape[dim] // self.size
        return whole.narrow(dim, self.group.rank * n, n)


def squares_counted_once(
    norms: Sequence[torch.Tensor], groups: Sequence[FlatParamGroup], tp_size: int
) -> torch.Tensor:
    """The sum of the squared gradient norms of `groups` (`norms[i]` is group i's), each
    element counted once over the job once it is summed over every rank.

    [Note: the clip norm under tensor parallelism]
    The sum over all ranks (data- and tensor-parallel) adds every group's shard once per
    rank that holds it. A split group's shards are other elements on every tensor-parallel
    rank, so they all count; a replicated group's are the same on all `tp_size` of them,
    so each counts 1/`tp_size` (exact for a power of two).
    """
    total = torch.zeros((), dtype=torch.float32, device=norms[0].device if norms else "cpu")
    for norm, g in zip(norms, groups, strict=True):
        square = norm.square().to(total.device)
        total += square if TensorParallel.is_split_group(g.key.process_group) else square / tp_size
    return total
