"""Stage 3's prefetch budget: the one rule `Stage3Runtime` prefetches by and the planner
prices (`estimate`'s gathered bytes and step time, `recommend`'s candidates)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from zeroshard.engine.config._policies import Stage3Policy


@dataclass(frozen=True)
class PrefetchBudget:
    """At most `depth` units ahead of the one in use, at most `prefetch_bytes` of them in
    flight at once, and no prefetch that would take the gathered bytes past
    `max_live_bytes`."""

    depth: int
    prefetch_bytes: int
    max_live_bytes: int

    @classmethod
    def of(cls, policy: Stage3Policy) -> PrefetchBudget:
        """The budget a stage-3 config sets."""
        return cls(policy.prefetch_depth, policy.prefetch_bytes, policy.max_live_bytes)

    def take(self, unit_bytes: Sequence[int], live_bytes: int) -> int:
        """How many of the released units next in order (`unit_bytes`, the `depth` after
        the one in use, less those gathered already) one prefetch starts while
        `live_bytes` are gathered: the longest prefix within both budgets."""
        in_flight = 0
        for k, nbytes in enumerate(unit_bytes):
            if in_flight + nbytes > self.prefetch_bytes:
                return k
            if live_bytes + in_flight + nbytes > self.max_live_bytes:
                return k
            in_flight += nbytes
        return len(unit_bytes)

    def admits(self, unit_bytes: int, live_bytes: int) -> bool:
        """Whether a unit of `unit_bytes` is prefetched at all while `live_bytes` are
        gathered (below that, every gather of it waits in line)."""
        return self.depth >= 1 and self.take([unit_bytes], live_bytes) == 1


def prefetch_bytes_for(unit_bytes: int, depth: int) -> int:
    """The least `prefetch_bytes` under which `depth` units of `unit_bytes` are in flight
    at once (`PrefetchBudget.take`)."""
    return max(1, unit_bytes * depth)
