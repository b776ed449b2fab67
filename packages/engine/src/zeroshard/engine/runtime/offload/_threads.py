"""The CPU threads of the host step while it runs beside the main thread.

[Note: host step threads]
torch's CPU kernels run on an OpenMP team of the thread that calls them (libgomp, in
torch's Linux wheels). Once two teams exist, libgomp manages more threads than there are
cores, and then lets an idle thread spin ~1000 times instead of ~300,000 before it sleeps
on a futex, so each of the host step's short parallel regions (four per block, tens of
microseconds each: [Note: blocked host step]) wakes its team from sleep: a block steps
markedly slower with the main thread's team beside the stepping thread's, whichever of
the two runs it, and so does `step_in_backward`, whose groups step on a thread of their
own ([Note: offload step pipeline]), against the serial step on the main thread
(docs/benchmarks.md, design-measurements). So while groups step on the stepping thread (under
`step_in_backward`, and `delay_param_update`'s step in flight), the main thread's team is
cut to `MAIN_KEEP` threads (libgomp ends a pool's surplus threads when a smaller region
starts) and the stepping thread takes the other cores. Meanwhile the main thread only
queues CUDA work (or waits in a backward that autograd's device thread runs); it gets
its thread count back when the stepping stops (`step()`, `settle`). On the CPU (gloo)
nothing changes: there forward and backward compute on the main thread's team.
"""

from __future__ import annotations

import torch

# A region of one thread never reaches OpenMP, so two is the fewest a team shrinks to.
MAIN_KEEP = 2
# Elements per thread that make a fill one parallel region of every thread asked for
# (above torch's 32768-element grain).
_REGION_NUMEL_PER_THREAD = 1 << 16


def cut_team() -> int:
    """Cut the calling thread's OpenMP team to `MAIN_KEEP` threads; return the thread
    count it had, to give back with `torch.set_num_threads`."""
    threads = torch.get_num_threads()
    if threads > MAIN_KEEP:
        torch.set_num_threads(MAIN_KEEP)
        # The region that makes libgomp end the pool's other threads.
        torch.empty(MAIN_KEEP * _REGION_NUMEL_PER_THREAD).fill_(0)
    return threads


def stepping_threads(main_threads: int) -> int:
    """The stepping thread's share of `main_threads` cores once the main team is cut."""
    return max(1, main_threads - MAIN_KEEP)
