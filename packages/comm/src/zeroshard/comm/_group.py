"""`Group`: one process group's collectives on flat tensors, with labelled timeouts.

[Note: streams and memory]
Issue. Every collective is issued with ``async_op=True``. On CUDA, NCCL runs it on the
process group's own communication stream (the side stream), which first waits on the
caller's *current* stream: whatever the current stream wrote before the call is complete
when the collective reads it. An input produced on another stream must be ordered
before the call by the caller (``current.wait_stream(producer)``).

Wait. `Handle.wait()` makes the caller's *current* stream wait on the collective; it
does not block the host (unless the group was made with ``blocking_wait=True``), so the
host can keep queueing work. Read an output, and write an input or output, only on a
stream that has waited. Every handle must be waited exactly once: wait() is what makes
the memory of its tensors safe to reuse.

Memory. The handle holds the input and output tensors until `wait()`. When the current
stream at `wait()` differs from the one at issue (issued from a prefetch stream, waited
on the compute stream), `wait()` marks them used on the waiting stream
(``record_stream``) before letting go: the caching allocator then hands their blocks to
new allocations of the issuing stream only after the waiting stream has passed this
point, hence after the collective. Without that, a buffer allocated on the issuing
stream and dropped after a wait on another stream could be reused by the issuing stream
while NCCL still reads or writes it. Nothing is held after `wait()`: no leak.

CPU. On gloo the same calls run on gloo's worker threads; `wait()` blocks the host
until the data is there, so the API is synchronous in effect and streams do not exist.

Timeouts. On gloo, `wait()` gives up after the group's `timeout` and raises
`CollectiveTimeoutError` naming the op and label. `with_timeout` also sets the process
group's own timeout (gloo's per-op timeout, NCCL's watchdog), so an abandoned collective
ends there too and the process can exit while a peer is still alive. What a gloo
collective holds is let go before the interpreter finalizes (see [Note: gloo at
interpreter exit] in `_inflight`), so a script that caught the error exits with its own
status. On NCCL, passing a
timeout to torch's wait would busy-wait the host, so by default the process group's own
timeout (set by `with_timeout`, else the one given to init_process_group / new_group)
applies, enforced by torch's NCCL watchdog, which names the op but cannot know our label.
``blocking_wait=True`` trades overlap for the labelled error on NCCL (a debugging aid;
the communicator is aborted after it).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from zeroshard.comm._errors import CollectiveTimeoutError
from zeroshard.comm._inflight import private_alias, track

ReduceOp = Literal["sum", "avg", "max"]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
_WAIT_GRACE = datetime.timedelta(seconds=0.5)

# torch 2.13 renamed the flat-tensor collectives and warns on the old names; older
# torch (2.6-2.12) has only the old ones.
_all_gather_flat = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class Handle:
    """A pending collective; `wait()` finishes it (see [Note: streams and memory])."""

    __slots__ = ("_after", "_blocking", "_keep", "_label", "_op", "_stream", "_timeout", "_work")

    def __init__(
        self,
        work: dist.Work | None,
        op: str,
        label: str,
        timeout: datetime.timedelta,
        keep: tuple[torch.Tensor, ...] = (),
        after: Callable[[], None] | None = None,
        *,
        blocking: bool = True,
    ) -> None:
        self._work = work
        self._op = op
        self._label = label
        self._timeout = timeout
        self._keep = keep
        self._after = after
        self._blocking = blocking
        # The stream current at issue: the one the collective's inputs were ordered on.
        self._stream: torch.cuda.Stream | None = None
        if work is not None and keep and keep[0].is_cuda:
            self._stream = torch.cuda.current_stream(keep[0].device)

    @property
    def op(self) -> str:
        """The collective's name ("all_gather", "reduce_scatter", ...)."""
        return self._op

    @property
    def label(self) -> str:
        """The caller's label for this collective."""
        return self._label

    @property
    def done(self) -> bool:
        """True once `wait()` has returned."""
        return self._work is None and self._after is None and not self._keep

    def wait(self) -> None:
        """Finish the collective or raise `CollectiveTimeoutError` naming it."""
        if self._work is not None:
            work, self._work = self._work, None
            start = time.monotonic()
            try:
                if self._blocking:
                    # The grace lets the process group's own timeout (the same, set by
                    # `with_timeout`) end the op first, so no worker thread is still
                    # inside it when we raise (an exit then would abort the process).
                    work.wait(self._timeout + _WAIT_GRACE)
                else:
                    # Stream-ordered only: the current stream waits, the host does not.
                    work.wait()
            except RuntimeError as e:
                self._keep = ()
                self._after = None
                raise CollectiveTimeoutError(
                    self._op, self._label, self._timeout, e, time.monotonic() - start
                ) from e
            if self._stream is not None:
                current = torch.cuda.current_stream(self._stream.device)
                if current != self._stream:
                    # See [Note: streams and memory]: free only after `current` passed here.
                    for t in self._keep:
                        t.record_stream(current)
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

    `pg` None means the default (world) group. `timeout` bounds every `wait()` on gloo
    (and on NCCL with `blocking_wait`); the error names the operation and the caller's
    label (a module, a bucket). See [Note: streams and memory] in this module.
    """

    pg: dist.ProcessGroup | None = None
    timeout: datetime.timedelta = DEFAULT_TIMEOUT
    blocking_wait: bool = False

    # A process group's rank, size and backend never change: look them up once (they sit
    # on the per-collective path, and each lookup walks torch's group registry).
    @functools.cached_property
    def rank(self) -> int:
        """This process's rank within the group."""
        return dist.get_rank(self.pg)

    @functools.cached_property
    def size(self) -> int:
        """Number of ranks in the group."""
        return dist.get_world_size(self.pg)

    @functools.cached_property
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
        if not 0 <= group_rank < self.size:
            raise ValueError(f"group rank {group_rank} is outside a group of {self.size} ranks")
        if self.pg is None:
            return group_rank
        return dist.get_global_rank(self.pg, group_rank)

    def with_timeout(self, timeout: datetime.timedelta) -> Group:
        """The same process group with another timeout, for our waits and torch's own.

        torch's process-group timeout bounds what our wait cannot: gloo's worker thread
        (else stuck in an abandoned collective until the peer exits, and the interpreter
        exit with it) and NCCL's watchdog (non-blocking waits). Setting it changes the
        process group for every caller, as asked: one timeout for every collective.
        """
        dist.distributed_c10d._set_pg_timeout(timeout, self.pg)
        return dataclasses.replace(self, timeout=timeout)

    def _handle(
        self,
        work: dist.Work | None,
        op: str,
        label: str,
        keep: tuple[torch.Tensor, ...],
        after: Callable[[], None] | None = None,
        given: tuple[torch.Tensor, ...] = (),
    ) -> Handle:
        if self.backend == "gloo" and work is not None:
            # See [Note: gloo at interpreter exit]: `given` are `_give`'s aliases.
            track(work, given, self.timeout.total_seconds())
        # gloo's wait honours the timeout without busy-waiting; NCCL's would block the host.
        blocking = self.blocking_wait or self.backend != "nccl"
        return Handle(work, op, label, self.timeout, keep, after, blocking=blocking)

    def _give(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # gloo gets private aliases, tracked by `_handle`: [Note: gloo at interpreter exit].
        if self.backend != "gloo":
            return tensors
        return tuple(private_alias(t) for t in tensors)

    def all_gather_into(
        self, output: torch.Tensor, input: torch.Tensor, *, label: str = ""
    ) -> Handle:
        """Gather every rank's `input` into `output` (size x input.numel(), rank-major)."""
        _check_flat_pair("all_gather_into", label, output, input, "output", self.size)
        if output.is_floating_point() and output.element_size() == 1:
            # gloo has no fp8 type; a gather only moves bytes: fp8 travels as uint8.
            output, input = output.view(torch.uint8), input.view(torch.uint8)
        given = self._give(output, input)
        work = _all_gather_flat(given[0], given[1], group=self.pg, async_op=True)
        return self._handle(work, "all_gather", label, (output, input), given=given)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        op: ReduceOp = "sum",
        label: str = "",
    ) -> Handle:
        """Reduce `input` (size x output.numel()) over ranks; keep this rank's part in `output`."""
        _check_flat_pair("reduce_scatter", label, input, output, "input", self.size)
        if self.backend == "gloo":
            return self._reduce_scatter_gloo(output, input, op, label)
        work = _reduce_scatter_flat(
            output, input, op=self._torch_op(op), group=self.pg, async_op=True
        )
        return self._handle(work, "reduce_scatter", label, (output, input), self._avg(op, output))

    def _reduce_scatter_gloo(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, label: str
    ) -> Handle:
        """[Note: gloo reduce-scatter] gloo's reduce-scatter work ignores the timeout given
        to wait() (it blocks until the peer answers or exits, and reports no completion to
        poll), so on gloo it is an all-reduce of a copy, whose wait honours the timeout,
        and this rank's part is copied out after it. CPU only: twice the bytes moved."""
        summed = input.clone()
        given = self._give(summed)
        work = dist.all_reduce(given[0], op=self._torch_op(op), group=self.pg, async_op=True)
        n = output.numel()
        part = summed[self.rank * n : (self.rank + 1) * n]
        avg = self._avg(op, output)

        def copy_out() -> None:
            output.copy_(part.view_as(output))
            if avg is not None:
                avg()

        return self._handle(work, "reduce_scatter", label, (output, summed), copy_out, given=given)

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
        *,
        label: str = "",
    ) -> Handle:
        """Send `input`'s r-th part (`input_splits[r]` elements, in rank order) to rank r;
        receive rank r's part for this rank as `output`'s r-th part (`output_splits[r]`)."""
        _check_contiguous("all_to_all", label, output, input)
        for name, t, splits in (("input", input, input_splits), ("output", output, output_splits)):
            if len(splits) != self.size or sum(splits) != t.numel() or min(splits) < 0:
                raise ValueError(
                    f"all_to_all {label!r}: {name} splits {list(splits)} do not cut its "
                    f"{t.numel()} elements into {self.size} parts"
                )
        if output.dtype != input.dtype:
            raise ValueError(
                f"all_to_all {label!r}: output dtype {output.dtype} != input {input.dtype}"
            )
        given = self._give(output, input)
        work = dist.all_to_all_single(
            given[0],
            given[1],
            list(output_splits),
            list(input_splits),
            group=self.pg,
            async_op=True,
        )
        return self._handle(work, "all_to_all", label, (output, input), given=given)

    def all_reduce(self, tensor: torch.Tensor, *, op: ReduceOp = "sum", label: str = "") -> Handle:
        """Reduce `tensor` in place over ranks."""
        _check_contiguous("all_reduce", label, tensor)
        given = self._give(tensor)
        work = dist.all_reduce(given[0], op=self._torch_op(op), group=self.pg, async_op=True)
        return self._handle(
            work, "all_reduce", label, (tensor,), self._avg(op, tensor), given=given
        )

    def broadcast(self, tensor: torch.Tensor, src: int, *, label: str = "") -> Handle:
        """Copy `tensor` from group rank `src` to every rank, in place."""
        _check_contiguous("broadcast", label, tensor)
        given = self._give(tensor)
        work = dist.broadcast(given[0], self.global_rank(src), group=self.pg, async_op=True)
        return self._handle(work, "broadcast", label, (tensor,), given=given)

    def barrier(self, *, label: str = "") -> None:
        """Block until every rank of the group gets here (bounded by the timeout)."""
        flag = torch.zeros(1, device=self.device)
        self.all_reduce(flag, label=label or "barrier").wait()
        if flag.is_cuda:
            # A barrier is a host-side promise: the stream-ordered wait is not enough.
            torch.cuda.current_stream(flag.device).synchronize()

    def _torch_op(self, op: ReduceOp) -> dist.ReduceOp.RedOpType:
        if op == "max":
            return dist.ReduceOp.MAX
        if op == "avg" and self.backend == "nccl":
            return dist.ReduceOp.AVG
        if op not in ("sum", "avg"):
            raise ValueError(f"unknown reduce op {op!r}; expected 'sum', 'avg' or 'max'")
        return dist.ReduceOp.SUM

    def _avg(self, op: ReduceOp, out: torch.Tensor) -> Callable[[], None] | None:
        # gloo has no AVG: sum, then divide once the data is there.
        if op != "avg" or self.backend == "nccl" or self.size == 1:
            return None
        size = self.size

        def divide() -> None:
            out.div_(size)

        return divide


def _check_flat_pair(
    op: str, label: str, full: torch.Tensor, part: torch.Tensor, full_name: str, size: int
) -> None:
    """`full` must hold `size` x `part`'s elements, of the same dtype, both contiguous."""
    if full.numel() != part.numel() * size:
        raise ValueError(
            f"{op} {label!r}: {full_name} has {full.numel()} elements, "
            f"expected {size} x {part.numel()}"
        )
    if full.dtype != part.dtype:
        output, input = (full, part) if full_name == "output" else (part, full)
        raise ValueError(f"{op} {label!r}: output dtype {output.dtype} != input {input.dtype}")
    _check_contiguous(op, label, full, part)


def _check_contiguous(op: str, label: str, *tensors: torch.Tensor) -> None:
    # NCCL and gloo read flat memory: a strided view would be a silent copy or an error.
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"{op} {label!r}: tensors must be contiguous (flat buffers)")
