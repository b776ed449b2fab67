"""Where the offloaded step's time goes on the host: the compiled AdamW kernel in the step
and alone (issue 73's bf16-masters goal, docs/benchmarks.md `offload-bf16-masters`).

    python -m benchmarks.offload.host_profile bf16      # the 7B step, bf16 masters (one GPU)
    python -m benchmarks.offload.host_profile fp32      # the same with fp32 masters
    python -m benchmarks.offload.host_profile alone     # the kernel alone, both precisions
    python -m benchmarks.offload.host_profile bf16 --threads 12   # the stepping team at 12
    python -m benchmarks.offload.host_profile bf16 --waits   # spinning against blocking waits
    python -m benchmarks.offload.host_profile bf16 --smoke   # tiny model on the CPU

`bf16`/`fp32`: the `train-zs-dpu-compiled[-bf16]` row's model and config at the offload
benchmark's defaults (GPT 7b width, 34 blocks, seq 2048, micro-batch 4, activation
checkpointing, stage 2; offload_delay_param_update, offload_compiled_step); per step
after 2 warmup: its wall time, the stepping thread's time inside the compiled kernel
(`step_piece`, summed over its pieces), when its last piece ends, and the main thread's
wait for the delayed step (`StepThread.settle`). `alone`: the same kernel over 2^30
elements in pieces of 2^24 on as many threads as the stepping thread gets (the cores
less `MAIN_KEEP`), nothing beside it, and its rate by bytes moved. `--threads N`: the
stepping thread's team (and the kernel alone's) at N threads instead, to see whether the
kernel is slower in the step for sharing the cores. `--waits`: the step's CUDA waits as
torch makes them (an event's or a stream's synchronize spins a core while it waits: the
main thread's, the gradient worker's, the stepping thread's) and blocking (events made
with `blocking=True`, a stream's synchronize through one), alternated in one process, 2
steps of each in 3 rounds (each after an untimed step): whether threads spinning beside
the stepping team slow its kernel. Prints; writes no section.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from benchmarks.offload import _worker
from benchmarks.offload.__main__ import parse_args
from zeroshard.engine.runtime.offload import _build, _host_offload, _step_thread
from zeroshard.engine.runtime.offload._compiled_step import _kernel
from zeroshard.engine.runtime.offload._threads import stepping_threads


def in_step(precision: str, smoke: bool, threads: int | None, waits: bool) -> None:
    """Time the kernel's pieces and the main thread's waits in the offloaded step (with
    `waits`, spinning CUDA waits against blocking ones)."""
    spans: list[tuple[str, float, float]] = []
    piece, settle = getattr(_host_offload, "step_piece"), _step_thread.StepThread.settle  # noqa: B009

    def timed_piece(*args: Any) -> None:
        start = time.perf_counter()
        piece(*args)
        spans.append(("kernel", start, time.perf_counter()))

    def timed_settle(self: _step_thread.StepThread) -> None:
        start = time.perf_counter()
        settle(self)
        spans.append(("settle", start, time.perf_counter()))

    # What the step calls, timed (the names are looked up at each call).
    setattr(_host_offload, "step_piece", timed_piece)  # noqa: B010
    setattr(_step_thread.StepThread, "settle", timed_settle)  # noqa: B010
    if threads is not None:  # the team the kernels compile for and step with

        def team(_: int) -> int:
            return threads

        for module in (_build, _step_thread):
            setattr(module, "stepping_threads", team)  # noqa: B010
    # The offload benchmark's model and config, from its own defaults.
    a = vars(parse_args(["--smoke"] if smoke else []))
    device = _worker._join_alone(smoke)
    torch.manual_seed(0)
    model, cfg = _worker._gpt(a, device)
    engine = "zs-dpu-compiled" + ("-bf16" if precision == "bf16" else "")
    step, _ = _worker._setup_zs(model, a, engine)
    shape = (a["micro_batch"], cfg.seq_len)
    x = torch.randint(0, cfg.vocab_size, shape, device=device)
    y = torch.randint(0, cfg.vocab_size, shape, device=device)
    for _ in range(2):
        step(x, y)
    _worker._sync(device)
    # (label, whether CUDA waits block) of each timed step; an untimed step opens a round.
    plan = [("", False, False)] * 4
    if waits:
        rounds = [("spinning", False), ("blocking", True), ("spinning", False)] * 2
        plan = [(f" {w}", b, first) for w, b in rounds for first in (True, False, False)]
    rows: dict[str, list[tuple[float, float, float, float]]] = {}
    for i, (label, blocking, untimed) in enumerate(plan):
        if waits:
            _cuda_waits(blocking)
        if untimed:
            step(x, y)
            _worker._sync(device)
            continue
        spans.clear()
        start = time.perf_counter()
        step(x, y)
        _worker._sync(device)
        wall = time.perf_counter() - start
        kernel = [s for s in spans if s[0] == "kernel"]
        busy = sum(end - begin for _, begin, end in kernel)
        last = max((end for _, _, end in kernel), default=start) - start
        wait = sum(end - begin for kind, begin, end in spans if kind == "settle")
        rows.setdefault(label, []).append((wall, busy, last, wait))
        print(
            f"{precision}{label} step {i}: wall {wall:.3f} s; kernel {busy:.3f} s over "
            f"{len(kernel)} pieces, the last ending at {last:.3f} s; settle waited {wait:.3f} s",
            flush=True,
        )
    team = "" if threads is None else f", {threads} stepping threads"
    for label, timed in rows.items():
        wall, busy, last, wait = (statistics.median(r[j] for r in timed) for j in range(4))
        print(
            f"| {precision} in the step{team}{label} | {wall:.3f} | {busy:.3f} | {last:.3f} "
            f"| {wait:.3f} |"
        )


_SPINNING_EVENT, _SPINNING_SYNC = torch.cuda.Event, torch.cuda.Stream.synchronize


class _BlockingEvent(torch.cuda.Event):
    """A CUDA event whose synchronize sleeps on the host instead of spinning."""

    def __new__(
        cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> Any:
        return super().__new__(cls, enable_timing, True, interprocess)


def _blocking_sync(stream: torch.cuda.Stream) -> None:
    """A stream's synchronize that sleeps: through a blocking event recorded on it."""
    event = _BlockingEvent()
    event.record(stream)
    event.synchronize()


def _cuda_waits(blocking: bool) -> None:
    """Make the events the step creates from now on, and its streams' synchronize,
    blocking or (torch's default) spinning."""
    event = _BlockingEvent if blocking else _SPINNING_EVENT
    torch.cuda.Event = torch.cuda.streams.Event = event
    torch.cuda.Stream.synchronize = _blocking_sync if blocking else _SPINNING_SYNC


def alone(smoke: bool, threads: int | None) -> None:
    """The compiled kernel alone, bf16 and fp32 masters (bf16 gradients), by bytes moved."""
    n, piece = (1 << 16, 1 << 12) if smoke else (1 << 30, 1 << 24)
    torch.set_num_threads(threads or stepping_threads(torch.get_num_threads()))
    coef = torch.tensor([0.99, 0.1, 0.95, 0.05, 0.5, 1e-8, -1e-4], dtype=torch.float32)
    for name, dtype, scale in (
        ("bf16 masters", torch.bfloat16, None),
        ("fp32 masters", torch.float32, torch.ones((), dtype=torch.float32)),
    ):
        kernel = _kernel(True, False, False, scale is not None)
        tensors = [torch.rand(n, dtype=dtype) for _ in range(3)]
        grad = torch.rand(n, dtype=torch.bfloat16)
        _pieces(kernel, tensors[0], grad, tensors[1:], coef, scale, piece)  # compiles
        times = []
        for _ in range(3):
            start = time.perf_counter()
            _pieces(kernel, tensors[0], grad, tensors[1:], coef, scale, piece)
            times.append(time.perf_counter() - start)
        seconds = min(times)
        moved = 6 * dtype.itemsize + grad.element_size()  # read 3 + the gradient, write 3
        print(
            f"| {name} alone, {torch.get_num_threads()} threads | {seconds / n * 7.06e9:.3f} s "
            f"at 7.06B | {moved * n / seconds / 1e9:.1f} GB/s ({moved} B an element) |",
            flush=True,
        )


def _pieces(
    kernel: Any,
    master: torch.Tensor,
    grad: torch.Tensor,
    moments: list[torch.Tensor],
    coef: torch.Tensor,
    scale: torch.Tensor | None,
    piece: int,
) -> None:
    """One step of the kernel over `master` in pieces, as the host step cuts a group."""
    for lo in range(0, master.numel(), piece):
        hi = lo + piece
        kernel(master[lo:hi], grad[lo:hi], *(m[lo:hi] for m in moments), None, None, coef, scale)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("bf16", "fp32", "alone"))
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    p.add_argument("--threads", type=int, help="the stepping team's threads")
    p.add_argument("--waits", action="store_true", help="spinning against blocking waits")
    a = p.parse_args()
    if a.what == "alone":
        alone(a.smoke, a.threads)
    else:
        in_step(a.what, a.smoke, a.threads, a.waits)


if __name__ == "__main__":
    main()
