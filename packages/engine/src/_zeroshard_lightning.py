"""zeroshard's Lightning strategy names, registered when Lightning loads its registries.

`Trainer(strategy="zeroshard_stage_3")` resolves the name before anything of the user's
runs, from registries Lightning fills with its own strategies only (it reads no entry
point before that), so without `import zeroshard.engine.lightning` first the name was
Lightning's generic "invalid strategy name". The engine's distribution installs
`zeroshard_engine_lightning.pth`, whose one line imports this module at interpreter start.
It imports nothing but the standard library and does nothing until Lightning imports
`lightning.pytorch.strategies` or `lightning.fabric.strategies`: right after either runs,
the names of `STRATEGIES` go into its registry, each built by importing
`zeroshard.engine.lightning` when the name is chosen (so a Lightning user who never picks
one never imports zeroshard). `zeroshard.engine.lightning` registers its classes over
these entries when imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

# Name -> (description, the `config=` the strategy is built with); zeroshard.engine.
# lightning registers its classes under the same table.
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

# Lightning's module -> (its registry's name there, the strategy class of
# zeroshard.engine.lightning that the names build).
_REGISTRIES = {
    "lightning.pytorch.strategies": ("StrategyRegistry", "ZeroShardStrategy"),
    "lightning.fabric.strategies": ("STRATEGY_REGISTRY", "ZeroShardFabricStrategy"),
}


class LazyStrategy:
    """Builds `zeroshard.engine.lightning.<cls>` when Lightning asks for a named strategy."""

    def __init__(self, cls: str) -> None:
        self.cls = cls

    def __call__(self, **init_params: Any) -> Any:
        module = importlib.import_module("zeroshard.engine.lightning")
        return getattr(module, self.cls)(**init_params)


def register(module: ModuleType) -> None:
    """Put every name of `STRATEGIES` not yet there into `module`'s strategy registry."""
    registry_name, cls = _REGISTRIES[module.__name__]
    registry = getattr(module, registry_name)
    for name, (description, config) in STRATEGIES.items():
        if name not in registry:
            registry.register(name, LazyStrategy(cls), description=description, config=config)


class _Registering(importlib.abc.Loader):
    """A loader that runs the module as its own loader would, then registers the names."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        try:
            register(module)
        except Exception as e:  # a Lightning this does not know: Lightning itself still works
            print(f"zeroshard: could not register its Lightning strategies: {e}", file=sys.stderr)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds Lightning's two strategy modules as the other finders do, with `_Registering`."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _REGISTRIES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Registering(spec.loader)
                return spec
        return None


def install() -> None:
    """Watch for Lightning's strategy modules (once), or register now if already loaded."""
    for name in _REGISTRIES:
        if name in sys.modules:
            register(sys.modules[name])
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
