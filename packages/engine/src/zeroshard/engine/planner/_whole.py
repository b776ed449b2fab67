"""What a whole-matrix optimizer's step costs (torch.optim.Muon, or one stepping whole
parameters): the owners `initialize` would choose (`plan_owners`, the runtime's own),
the Newton-Schulz FLOPs each rank runs, and the bytes each rank sends and receives to
and from the owners per step, beside what the step's other collectives move.

Per exchanged element (a matrix not whole in its owner's shard; a rank's own piece does
not travel): Muon sends its update to the owner in bf16 and gets it back orthogonalized
in bf16, 2 + 2 bytes, whatever the masters' dtype; an optimizer on whole parameters sends
the gradient and the master, both in the master dtype (`precision.master_dtype`: 4 + 4
bytes for fp32 masters, 2 + 2 for bf16 ones), and gets the master back (4, or 2). AdamW
moves nothing at the step beyond the all-gather of the parameters (stages 1/2) that every
optimizer does.

[Note: the whole-matrix step's scratch]
What the step allocates on the device beside the model states, as `MuonStep` and
`WholeParamStep` do (`tests/engine/test_plan_tensor_parallel.py` checks each term against
the engine's tensors): Muon's bf16 update of one flat group's shard at a time (on the
device even for a group offload homes on the host: it goes up for the exchange); every
group's owner buffer and the buffer its pieces come back in, alive until the step ends
(a rank's own pieces of an exchanged matrix travel too, to itself); and the
orthogonalization of one group's local or owned matrices (`MuonStep._orthogonalized`),
one call at a time: Newton-Schulz's results, kept until the call returns, and the
iterates of the matrix in progress ([Note: Newton-Schulz's memory]); under tensor
parallelism ([Note: Muon under tensor parallelism] in runtime/whole/_muon.py) on the
matrices joined whole over tp, after their pieces' copy, the all-gather's buffer and the
joined copies, which stay beside them. A declared optimizer ([Note: whole parameters]
in runtime/whole/_whole_step.py) holds every matrix it steps whole at once, its step()
being one call: under tensor parallelism the gradients and masters of its split matrices
joined over tp (per group's local and owned matrices, one join at a time: the pieces'
copy, the all-gather's buffer and the joined copies, which stay until step() returns);
for a group offload homes on the host, the device's copies of its gradient and master
shard and the state of its matrices this rank owns, brought up for the step ([Note:
whole parameters offloaded]): `WholeMatrixCost.held_bytes`. What its step() allocates
beyond is its own: not counted (its state at the owners is, as a step of the optimizer
on a meta matrix of each shape allocates it ([Note: a declared optimizer's state,
measured] in runtime/_owner_state.py): `WholeMatrixCost.owner_state_bytes`, and
`owner_host_state_bytes` where offload keeps it on the host between steps; under tp it
is the whole matrix's on each tp rank).

[Note: Newton-Schulz's memory]
torch's `_zeropower_via_newtonschulz` on a matrix of r x c (r <= c, transposed to be so)
that is already bf16 (Muon's update, the owner's buffer, the joined copies: NS divides it
in place) allocates per iteration X X^T (r x r), the addmm of it with its square (r x r)
and the next X (r x c), all bf16; each replaces its namesake of the iteration before only
once it exists. So from the second iteration on, X, the last two r x r and a new one are
alive (rc + 3r^2), then X, both r x r and the next X (2rc + 2r^2): the peak is
2 (2rc + 2r^2) bytes, of which the result keeps 2rc (one iteration: 2 (rc + 2r^2)).
Measured by the CPU allocator's own reports (torch.profiler's memory events) in
`tests/engine/test_estimate_states.py` and `test_plan_tensor_parallel.py`, live bytes
taken at the end of each operator (a CPU bf16 matmul allocates scratch within the
operator that a GPU's cuBLAS does not).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.runtime._group_plan import PlannedFlatGroup
from zeroshard.engine.runtime._home import HomeKind
from zeroshard.engine.runtime._owner_state import OwnerState
from zeroshard.engine.runtime._tensor_parallel import SPLIT_LABEL
from zeroshard.engine.runtime.whole import (
    MatrixOwners,
    plan_owners,
    split_muon,
    steps_whole,
    torch_muon,
)
from zeroshard.partition import DEFAULT_GROUP_LABEL

# Muon's bytes per exchanged element, to the owner and back ([module docstring]).
SPLIT_BYTES = (2, 2)


def whole_bytes(cfg: ZeroConfig) -> tuple[int, int]:
    """An optimizer on whole parameters: bytes per exchanged element to the owner (the
    gradient shard and the master, in the master dtype) and back (the master)."""
    master = cfg.precision.master_dtype.itemsize
    return 2 * master, master


@dataclass(frozen=True)
class WholeMatrixCost:
    """One rank's view of the whole-matrix step of a run (the default process group).

    Attributes:
        owners: each matrix's owner and Newton-Schulz FLOPs (`balance`: max / mean).
        sent_bytes / received_bytes: the busiest rank's bytes per step to and from
            the other ranks in the exchange with the owners.
        other_bytes: what one rank sends per step in the step's other collectives
            (reduce-scatters and gathers), for comparison.
        exchanges: all-to-alls per step (per flat group with a matrix to move: Muon's
            update there and back, or a gradient, a master and the master back).
        update_bytes: Muon's largest bf16 update of one flat group's shard.
        buffer_bytes: the busiest rank's owner buffers and the buffers its pieces come
            back in, every group's (alive until the step ends).
        joined_bytes: under tensor parallelism, the most bytes of matrices one rank
            joins whole over tp at once (Muon's bf16 updates; a declared optimizer's
            gradients and masters, in the master dtype).
        orthogonalize_bytes: the most bytes one orthogonalization of a group's local or
            owned matrices allocates beyond its inputs (under tp the joining, then
            Newton-Schulz's results and iterates: [Note: Newton-Schulz's memory]).
        owner_state_bytes: the busiest rank's state of the optimizers that step whole
            parameters with their own step(), kept at the owners on the device (as their
            step allocates it on whole matrices in the master dtype: `OwnerState`; their
            param groups keep none on the shards: `owner_state_groups`); under tp each
            whole matrix's on every tp rank.
        owner_host_state_bytes: the same of the matrices of groups offload homes on the
            host, kept there between steps.
        held_bytes: what such an optimizer's step holds on the busiest rank beside the
            buffers, its matrices joined over tp and an offloaded group's copies and
            state on the device ([Note: the whole-matrix step's scratch]).
    """

    owners: MatrixOwners
    sent_bytes: int
    received_bytes: int
    other_bytes: int
    exchanges: int
    update_bytes: int = 0
    buffer_bytes: int = 0
    joined_bytes: int = 0
    orthogonalize_bytes: int = 0
    owner_state_bytes: int = 0
    owner_host_state_bytes: int = 0
    held_bytes: int = 0

    @property
    def scratch(self) -> int:
        """Device bytes the step allocates at its peak beside the model states ([Note:
        the whole-matrix step's scratch])."""
        return self.update_bytes + self.buffer_bytes + self.orthogonalize_bytes + self.held_bytes

    @property
    def balance(self) -> float:
        """The busiest rank's Newton-Schulz FLOPs over the mean."""
        return self.owners.balance

    @property
    def max_flops(self) -> int:
        """Newton-Schulz FLOPs of the busiest rank per step."""
        return max(self.owners.loads(), default=0)


def hidden_matrices(model: nn.Module) -> list[bool]:
    """For each of `model.parameters()`: whether it is a hidden matrix, the parameters
    torch.optim.Muon's documentation gives Muon (2-D weights, but the embeddings and the
    output head: a Linear as wide as the vocabulary)."""
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    # The token embedding's (position embeddings are narrower).
    vocab = max((m.num_embeddings for m in embeddings), default=0)
    outer = {id(m.weight) for m in embeddings}
    outer |= {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, nn.Linear) and m.out_features == vocab
    }
    return [p.dim() == 2 and id(p) not in outer for p in model.parameters()]


def muon_recipe(model: nn.Module) -> list[torch.optim.Optimizer]:
    """torch's recipe, for planning: torch.optim.Muon on the hidden matrices, AdamW on the
    rest (default settings; a plan needs only which parameters each steps)."""
    params = list(model.parameters())
    hidden = hidden_matrices(model)
    matrices = [p for p, h in zip(params, hidden, strict=True) if h]
    rest = [p for p, h in zip(params, hidden, strict=True) if not h]
    muon: Any = torch_muon()
    if muon is None:
        raise ValueError(f"this torch ({torch.__version__}) has no torch.optim.Muon")
    return [muon(matrices), torch.optim.AdamW(rest)]


def owner_state_groups(optimizers: Sequence[torch.optim.Optimizer]) -> set[int]:
    """The param groups (by index among all optimizers' in turn) of optimizers that step
    whole parameters with their own step(): their state is at the owners, not on shards."""
    of = param_group_optimizers(optimizers)
    return {k for k, o in enumerate(of) if steps_whole(o) and not split_muon(o)}


def param_group_optimizers(
    optimizers: Sequence[torch.optim.Optimizer],
) -> list[torch.optim.Optimizer]:
    """The optimizer of each param group, in the order of all param groups in turn."""
    return [o for o in optimizers for _ in o.param_groups]


def newton_schulz_bytes(shape: Sequence[int], steps: int) -> tuple[int, int]:
    """The most bytes torch's Newton-Schulz holds at once on a bf16 matrix of `shape` in
    `steps` iterations, and those of its result ([Note: Newton-Schulz's memory])."""
    r, c = sorted(shape)
    if steps == 0:
        return 0, 0  # the input itself comes back
    peak = r * c + 2 * r * r if steps == 1 else max(r * c + 3 * r * r, 2 * r * c + 2 * r * r)
    return 2 * peak, 2 * r * c


def orthogonalize_bytes(shapes: Sequence[Sequence[int]], steps: int, tp: int = 1) -> int:
    """The most bytes one `MuonStep._orthogonalized` call allocates beyond its inputs, on
    matrices of `shapes` (whole) in turn: their results are kept until it returns; with
    `tp` above 1 their pieces first joined whole ([Note: the whole-matrix step's
    scratch])."""
    done = peak = 0
    for shape in shapes:
        most, result = newton_schulz_bytes(shape, steps)
        peak = max(peak, done + most)
        done += result
    if tp == 1:
        return peak
    # The pieces' copy, the all-gather's buffer and the joined copies; then the joined
    # copies beside Newton-Schulz.
    joined = sum(2 * math.prod(s) for s in shapes)
    return max(joined // tp + 2 * joined, joined + peak)


def whole_matrix_cost(
    groups: Sequence[PlannedFlatGroup],
    cfg: ZeroConfig,
    optimizers: Sequence[torch.optim.Optimizer],
    tp: int = 1,
    whole_shapes: Mapping[str, Sequence[int]] | None = None,
) -> WholeMatrixCost | None:
    """The whole-matrix step of the planned `groups` (None: no optimizer steps whole), on
    the default process group and, under tensor parallelism over `tp` ranks, on the
    flat groups of split parameters (sharded over the same data-parallel ranks), whose
    whole shapes `whole_shapes` gives by name."""
    of = param_group_optimizers(optimizers)
    ns = {
        k: int(o.param_groups[k - of.index(o)].get("ns_steps", 5))
        for k, o in enumerate(of)
        if steps_whole(o)
    }
    if not ns:
        return None
    labels = (DEFAULT_GROUP_LABEL, SPLIT_LABEL)
    by_label = plan_owners(((g.key, g.layout) for g in groups), ns)
    found = [by_label[label] for label in labels if label in by_label]
    if not found:
        return None
    size = found[0].size
    owners = MatrixOwners(
        size,
        {n: r for o in found for n, r in o.owner.items()},
        tuple(m for o in found for m in o.matrices),
    )
    sent, received, joined = [0] * size, [0] * size, [0] * size
    # Each rank's owner buffers and the buffers its pieces come back in (its own pieces
    # of an exchanged matrix travel too, to itself).
    buffers = [0] * size
    orthogonalize = [0] * size
    # Each rank's state of the optimizers on whole parameters, at the owners (on the
    # device, on the host), and what their step holds whole beside the buffers.
    state, host_state = [0] * size, [0] * size
    held = [_Held() for _ in range(size)]
    # A declared optimizer's state per whole matrix, measured ([Note: a declared
    # optimizer's state, measured] in runtime/_owner_state.py).
    owner_state = OwnerState(optimizers, cfg.precision.master_dtype)
    master = cfg.precision.master_dtype.itemsize
    exchanges = update = 0
    for g in groups:
        if not g.trainable or g.key.param_group not in ns or g.key.process_group not in labels:
            continue
        split = split_muon(of[g.key.param_group])
        if split:
            update = max(update, g.layout.shard_numel * 2)
        out, back = SPLIT_BYTES if split else whole_bytes(cfg)
        moved = False
        local, owned = [0] * size, [0] * size
        # Each rank's local and owned matrices, whole, in the order it orthogonalizes them.
        shapes: list[list[list[Sequence[int]]]] = [[[], []] for _ in range(size)]
        on_host = g.home is HomeKind.HOST
        tp_split = g.key.process_group == SPLIT_LABEL and whole_shapes is not None
        joins = split and tp_split
        if not split and on_host:
            # The device's copies of its gradient and master shard ([Note: the whole-matrix
            # step's scratch]).
            for h in held:
                h.copies += 2 * g.layout.shard_numel * master
        for s in g.layout.slots:
            o = owners.owner[s.name]
            shape = whole_shapes[s.name] if tp_split and whole_shapes is not None else s.shape
            if not split:
                kept = owner_state.nbytes(g.key.param_group, shape)
                state[o] += 0 if on_host else kept
                host_state[o] += kept if on_host else 0
                held[o].state += kept if on_host else 0
            pieces = [p for p in g.layout.pieces(s) if p.numel]
            if all(p.rank == o for p in pieces):
                local[o] += s.numel
                shapes[o][0].append(shape)
                continue
            owned[o] += s.numel
            shapes[o][1].append(shape)
            buffers[o] += s.numel * out
            for piece in pieces:
                buffers[piece.rank] += piece.numel * back
                if piece.rank == o:
                    continue
                moved = True
                sent[piece.rank] += piece.numel * out
                received[o] += piece.numel * out
                sent[o] += piece.numel * back
                received[piece.rank] += piece.numel * back
        if joins:
            # Each rank joins its local matrices, then its owned ones, in bf16.
            joined = [
                max(j, tp * 2 * max(a, b)) for j, a, b in zip(joined, local, owned, strict=True)
            ]
        elif not split and tp_split:
            # Each rank joins the gradients and masters of its local matrices, then of its
            # owned ones, in the master dtype: the joins of every group kept to the end.
            for r, h in enumerate(held):
                h.local.append(2 * master * local[r])
                h.owned.append(2 * master * owned[r])
            joined = [
                max(j, tp * 2 * master * max(a, b))
                for j, a, b in zip(joined, local, owned, strict=True)
            ]
        if split:
            steps = ns[g.key.param_group]
            orthogonalize = [
                max(most, *(orthogonalize_bytes(m, steps, tp if joins else 1) for m in rank))
                for most, rank in zip(orthogonalize, shapes, strict=True)
            ]
        # Muon sends one update; whole parameters a gradient and a master: 2 or 3 in all.
        exchanges += (2 if split else 3) if moved else 0
    other = _other_bytes(groups, cfg, size)
    return WholeMatrixCost(
        owners,
        max(sent),
        max(received),
        other,
        exchanges,
        update,
        max(buffers),
        max(joined),
        max(orthogonalize),
        max(state),
        max(host_state),
        max(h.peak(tp) for h in held),
    )


@dataclass
class _Held:
    """What one rank's declared-optimizer step holds whole beside the buffers ([Note: the
    whole-matrix step's scratch]): the device's copies of offloaded shards, the offloaded
    state brought up, and the bytes of each join over tp (local ones in group order, then
    owned ones)."""

    copies: int = 0
    state: int = 0
    local: list[int] = field(default_factory=list)
    owned: list[int] = field(default_factory=list)

    def peak(self, tp: int) -> int:
        """The most held at once: the joins done so far and the one in progress (its
        pieces' copy, the all-gather's buffer and its joined copies)."""
        done = most = 0
        for b in (b for b in (*self.local, *self.owned) if b):
            most = max(most, done + b * (1 + 2 * tp))
            done += tp * b
        return self.copies + self.state + max(most, done)


def _other_bytes(groups: Sequence[PlannedFlatGroup], cfg: ZeroConfig, size: int) -> int:
    """Bytes one rank sends per step in the reduce-scatters and gathers (ring: (n-1)/n of
    each buffer): stages 1/2 reduce and publish the trainable groups, stage 3 gathers
    every group twice and reduces the trainable ones."""
    compute = cfg.precision.compute_dtype.itemsize
    reduce = torch.empty(0, dtype=cfg.precision.grad_reduce_dtype).element_size()
    total = 0
    for g in groups:
        if cfg.stage == 3:
            per = 2 * compute + (reduce if g.trainable else 0)
        else:  # only the trainable groups are reduced and published
            per = compute + reduce if g.trainable else 0
        total += g.layout.padded_numel * per * (size - 1) // size
    return total
