"""`EngineStats`: the stage-3 communication counters, shared by the eager engine and compile."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    """Counters for tests and benchmarks (stage 3, eager or compiled); reset with `reset()`.

    `live_bytes` / `peak_live_bytes` count gathered parameter buffers only;
    `scale_reductions` the all-reduces of the fp8 weights' amaxes (one per step and
    process group, and one more over tp under tensor parallelism: [Note: the fp8 gather]).
    """

    gathers: int = 0
    bytes_gathered: int = 0
    reduce_scatters: int = 0
    bytes_reduced: int = 0
    live_bytes: int = 0
    peak_live_bytes: int = 0
    prefetches: int = 0
    order_changes: int = 0
    scale_reductions: int = 0

    def reset(self) -> None:
        """Zero every counter but the live bytes (which describe the present)."""
        live = self.live_bytes
        for name in self.__dataclass_fields__:
            setattr(self, name, 0)
        self.live_bytes = self.peak_live_bytes = live

    def gathered(self, nbytes: int, *, prefetch: bool = False) -> None:
        """Count a gather of `nbytes` whose buffer is live from now on."""
        self.gathers += 1
        self.prefetches += int(prefetch)
        self.bytes_gathered += nbytes
        self.live_bytes += nbytes
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)

    def released(self, nbytes: int) -> None:
        """Count the release of a gathered buffer of `nbytes`."""
        self.live_bytes -= nbytes

    def reduced(self, nbytes: int) -> None:
        """Count a reduce-scatter of a full gradient of `nbytes`."""
        self.reduce_scatters += 1
        self.bytes_reduced += nbytes
