"""zeroshard for PyTorch Lightning: a strategy for the Trainer and one for Fabric (needs the
`lightning` extra).

    import zeroshard.engine.lightning  # optional once installed: see _zeroshard_lightning.py
    trainer = lightning.pytorch.Trainer(strategy="zeroshard_stage_3", precision="bf16-mixed")
    trainer = lightning.pytorch.Trainer(strategy=ZeroShardStrategy(config={"stage": 3, ...}))
    fabric = lightning.fabric.Fabric(strategy="zeroshard_stage_2")

Importing this package registers the names of `STRATEGIES` in both of Lightning's strategy
registries (Lightning has no entry point for strategies of other packages); an installed
engine has registered them already, lazily, when Lightning loaded (`_zeroshard_lightning`,
beside the `zeroshard` package, from the distribution's `.pth` line). An
integration: it uses the engine's public functions from their own modules, never the
engine's public face; docs/coming-from.md ("Lightning") is the guide.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from zeroshard.engine.lightning._checkpoint import TAG
from zeroshard.engine.lightning._fabric import ZeroShardFabricStrategy
from zeroshard.engine.lightning._precision import (
    COMPUTE_DTYPES,
    ZeroShardFabricPrecision,
    ZeroShardPrecision,
)
from zeroshard.engine.lightning._registry import STRATEGIES
from zeroshard.engine.lightning._trainer import ZeroShardStrategy

__all__ = [
    "COMPUTE_DTYPES",
    "STRATEGIES",
    "TAG",
    "ZeroShardFabricPrecision",
    "ZeroShardFabricStrategy",
    "ZeroShardPrecision",
    "ZeroShardStrategy",
]

ZeroShardStrategy.register_strategies(StrategyRegistry)
ZeroShardFabricStrategy.register_strategies(STRATEGY_REGISTRY)
