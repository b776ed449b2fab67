"""The names the strategies register in Lightning's registries, as DeepSpeed's are named.

The same table is in `_zeroshard_lightning` (beside the `zeroshard` package), which the
engine's `.pth` line imports at interpreter start to register these names lazily when
Lightning loads its registries; importing this package puts the classes in their place."""

from __future__ import annotations

from typing import Any

STRATEGIES: dict[str, tuple[str, dict[str, Any] | None]] = {
    "zeroshard": ("zeroshard, its default config (ZeRO stage 2)", None),
    "zeroshard_stage_1": ("zeroshard ZeRO stage 1", {"stage": 1}),
    "zeroshard_stage_2": ("zeroshard ZeRO stage 2", {"stage": 2}),
    "zeroshard_stage_2_offload": (
        "zeroshard ZeRO stage 2, optimizer state on the CPU",
        {"stage": 2, "offload_optimizer": True},
    ),
    "zeroshard_stage_3": ("zeroshard ZeRO stage 3", {"stage": 3}),
    "zeroshard_stage_3_offload": (
        "zeroshard ZeRO stage 3, optimizer state and parameters on the CPU",
        {"stage": 3, "offload_optimizer": True, "offload_params": True},
    ),
}
"""Name -> (description, the `config=` it builds the strategy with)."""


def register(registry: Any, strategy: type) -> None:
    """Register every name of `STRATEGIES` for `strategy` in a Lightning strategy registry."""
    for name, (description, config) in STRATEGIES.items():
        current = registry[name]["strategy"] if name in registry else None
        if current is strategy:
            continue  # registered already (the module imported again)
        # The lazy entry `_zeroshard_lightning` registered when Lightning loaded.
        lazy = type(current).__name__ == "LazyStrategy"
        registry.register(name, strategy, description=description, override=lazy, config=config)
