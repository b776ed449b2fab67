"""`recommend()`: the config the model predicts fastest within a memory limit."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.planner._estimate import Estimate
from zeroshard.engine.runtime._prefetch import prefetch_bytes_for


@dataclass(frozen=True)
class Recommendation:
    """The fastest fitting candidate (None if none fits) and every candidate estimated."""

    best: Estimate | None
    candidates: tuple[Estimate, ...]


def candidate_configs(
    base: ZeroConfig, world: int, gpus_per_node: int, largest_unit_bytes: int
) -> list[ZeroConfig]:
    """Stages 2 and 3, full sharding or shard groups of one node, offload off or on (with
    `base`'s delay_param_update where that is allowed: stage 2); at stage 3 also
    `prefetch_bytes` raised to hold `prefetch_depth` of the largest units (below that the
    engine does not prefetch them at all)."""
    delayed = base.offload.delay_param_update
    shards = sorted({world, *([gpus_per_node] if gpus_per_node < world else [])})
    enough = prefetch_bytes_for(largest_unit_bytes, base.stage3.prefetch_depth)
    out = []
    for stage in (2, 3):
        prefetch = sorted(
            {base.stage3.prefetch_bytes, enough} if stage == 3 else {base.stage3.prefetch_bytes}
        )
        for shard in shards:
            for offload in (False, True):
                for nbytes in prefetch:
                    out.append(
                        base.replace(
                            stage=stage,
                            shard_group_size=None if shard == world else shard,
                            offload_optimizer=offload,
                            offload_ratio=1.0,
                            offload_params=False,
                            offload_delay_param_update=delayed and offload and stage == 2,
                            prefetch_bytes=nbytes,
                        )
                    )
    return out


MEMORY_ONLY_RULE = (
    "of the configs that fit, the one with the least overhead: offload off before on (the "
    "host's step is the slowest part of an offloaded one), stage 2 before 3 (no parameter "
    "gathers), at stage 3 the larger prefetch, then the smaller peak"
)


def _memory_only_key(e: Estimate) -> tuple[float, ...]:
    """Without step times: the order of MEMORY_ONLY_RULE."""
    c = e.config
    prefetch = c.stage3.prefetch_bytes if c.stage == 3 else 0
    return (float(c.offload.optimizer), float(c.stage), -float(prefetch), float(e.peak))


def recommend(
    configs: list[ZeroConfig], run: Callable[[ZeroConfig], Estimate], limit_bytes: int
) -> Recommendation:
    """Estimate each config with `run`; the fastest whose projected peak fits `limit_bytes`
    (or, without step times, the first fitting one in the order of MEMORY_ONLY_RULE)."""
    done = tuple(run(c) for c in configs)
    fitting = [e for e in done if e.peak <= limit_bytes]

    def key(e: Estimate) -> tuple[float, ...]:
        return (e.step.total_s,) if e.step is not None else _memory_only_key(e)

    return Recommendation(min(fitting, key=key) if fitting else None, done)
