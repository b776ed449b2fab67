"""The names the strategies register in Lightning's registries, as DeepSpeed's are named.

The table is `_zeroshard_lightning`'s (beside the `zeroshard` package), which the
engine's `.pth` line imports at interpreter start to register these names lazily when
Lightning loads its registries; importing this package puts the classes in their place."""

from __future__ import annotations

from typing import Any

from _zeroshard_lightning import STRATEGIES as STRATEGIES


def register(registry: Any, strategy: type) -> None:
    """Register every name of `STRATEGIES` for `strategy` in a Lightning strategy registry."""
    for name, (description, config) in STRATEGIES.items():
        current = registry[name]["strategy"] if name in registry else None
        if current is strategy:
            continue  # registered already (the module imported again)
        # The lazy entry `_zeroshard_lightning` registered when Lightning loaded.
        lazy = type(current).__name__ == "LazyStrategy"
        registry.register(name, strategy, description=description, override=lazy, config=config)
