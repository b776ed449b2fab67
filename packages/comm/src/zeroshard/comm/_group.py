"""`Group`: one process group's collectives on flat tensors, with labelled timeouts.

[Note: streams and memory]
On CUDA every collective is issued with ``async_op=True``. NCCL runs it on the process
group's own communication stream, which first waits on the caller's current stream, so
inputs written before the call are complete when the collective reads them. The
`Handle` keeps the input and output tensors alive until `wait()`; `wait()` makes the
caller's *current* stream wait on the collective (it does not block the host), after
which the caching allocator may reuse the input's memory as soon as the caller drops
it. Rule: do not write an input or read an output before `wait()`, and call `wait()`
on the stream that will use the output. On CPU (gloo) the same calls return handles
whose `wait()` blocks the host until the data is there; nothing else differs.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from zeroshard.comm._errors import CollectiveTimeoutError

ReduceOp = Literal["sum", "avg", "max"]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)

# torch 2.13 renamed the flat-tensor collectives and warns on the old names; older
# torch (2.6-2.12) has only the old ones.
_all_gather_flat = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class Handle:
    """A pending collective; `wait()` finishes it (see [Note: streams and memory])."""

    __slots__ = ("_after", "_keep", "_label", "_op", "_timeout", "_work")

    def __init__(
        self,
        work: dist.Work | None,
        op: str,
        label: str,
        timeout: datetime.timedelta,
        keep: tuple[torch.Tensor, ...] = (),
        after: Callable[[], None] | None = None,
    ) -> None:
        self._work = work
        self._op = op
        self._label = label
        self._timeout = timeout
        self._keep = keep
        self._after = after

    @property
    def done(self) -> bool:
        """True once `wait()` has returned."""
        return self._work is None and self._after is None

    def wait(self) -> None:
        """Finish the collective or raise `CollectiveTimeoutError` naming it."""
        if self._work is not None:
            work, self._work = self._work, None
            try:
                work.wait(self._timeout)
            except RuntimeError as e:
                raise CollectiveTimeoutError(self._op, self._label, self._timeout, e) from e
        self._keep = ()
        if self._after is not None:
            after, self._after = self._after, None
            after()


def completed_handle() -> Handle:
    """A handle with nothing left to wait for (world size 1, empty inputs)."""
    return Handle(None, "noop", "", DEFAULT_TIMEOUT)


@dataclass(frozen=True)
class Group:
    """A torch process group seen as flat-tensor collectives.

    `pg` None means the default (world) group. `timeout` bounds every `wait()`; the
    error names the operation and the caller's label (a module, a bucket).
    """

    pg: dist.ProcessGroup | None = None
    timeout: datetime.timedelta = DEFAULT_TIMEOUT

    @property
    def rank(self) -> int:
        """This process's rank within the group."""
        return dist.get_rank(self.pg)

    @property
    def size(self) -> int:
        """Number of ranks in the group."""
        return dist.get_world_size(self.pg)

    @property
    def backend(self) -> str:
        """The backend name, 'gloo' or 'nccl'."""
        return str(dist.get_backend(self.pg))

    @property
    def device(self) -> torch.device:
        """Where this group's tensors must live: the current CUDA device for NCCL, else CPU."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def global_rank(self, group_rank: int) -> int:
        """The world rank of a rank of this group."""
        if self.pg is None:
            return group_rank
        return dist.get_global_rank(self.pg, group_rank)

    def with_timeout(self, timeout: datetime.timedelta) -> Group:
        """The same process group with another wait timeout."""
        return Group(self.pg, timeout)

    def _handle(
        self,
        work: dist.Work | None,
        op: str,
        label: str,
        keep: tuple[torch.Tensor, ...],
        after: Callable[[], None] | None = None,
    ) -> Handle:
        return Handle(work, op, label, self.timeout, keep, after)

    def all_gather_into(
        self, output: torch.Tensor, input: torch.Tensor, *, label: str = ""
    ) -> Handle:
        """Gather every rank's `input` into `output` (size x input.numel(), rank-major)."""
        if output.numel() != input.numel() * self.size:
            raise ValueError(
                f"all_gather_into {label!r}: output has {output.numel()} elements, "
                f"expected {self.size} x {input.numel()}"
            )
        if output.dtype != input.dtype:
            raise ValueError(
                f"all_gather_into {label!r}: output dtype {output.dtype} != input {input.dtype}"
            )
        work = _all_gather_flat(output, input, group=self.pg, async_op=True)
        return self._handle(work, "all_gather", label, (output, input))

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        op: ReduceOp = "sum",
        label: str = "",
    ) -> Handle:
        """Reduce `input` (size x output.numel()) over ranks; keep this rank's part in `output`."""
        if input.numel() != output.numel() * self.size:
            raise ValueError(
                f"reduce_scatter {label!r}: input has {input.numel()} elements, "
                f"expected {self.size} x {output.numel()}"
            )
        work = _reduce_scatter_flat(
            output, input, op=self._torch_op(op), group=self.pg, async_op=True
        )
        return self._handle(work, "reduce_scatter", label, (output, input), self._avg(op, output))

    def all_reduce(self, tensor: torch.Tensor, *, op: ReduceOp = "sum", label: str = "") -> Handle:
        """Reduce `tensor` in place over ranks."""
        work = dist.all_reduce(tensor, op=self._torch_op(op), group=self.pg, async_op=True)
        return self._handle(work, "all_reduce", label, (tensor,), self._avg(op, tensor))

    def broadcast(self, tensor: torch.Tensor, src: int, *, label: str = "") -> Handle:
        """Copy `tensor` from group rank `src` to every rank, in place."""
        work = dist.broadcast(tensor, self.global_rank(src), group=self.pg, async_op=True)
        return self._handle(work, "broadcast", label, (tensor,))

    def barrier(self, *, label: str = "") -> None:
        """Block until every rank of the group gets here (bounded by the timeout)."""
        flag = torch.zeros(1, device=self.device)
        self.all_reduce(flag, label=label or "barrier").wait()

    def _torch_op(self, op: ReduceOp) -> dist.ReduceOp.RedOpType:
        if op == "max":
            return dist.ReduceOp.MAX
        if op == "avg" and self.backend == "nccl":
            return dist.ReduceOp.AVG
        return dist.ReduceOp.SUM

    def _avg(self, op: ReduceOp, out: torch.Tensor) -> Callable[[], None] | None:
        # gloo has no AVG: sum, then divide once the data is there.
        if op != "avg" or self.backend == "nccl" or self.size == 1:
            return None
        size = self.size

        def divide() -> None:
            out.div_(size)

        return divide
