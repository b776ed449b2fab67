"""The module the engine is built on, built once per user module and found again.

[Note: the engine's root]
Lightning calls `training_step` (and the other step methods) on the LightningModule, not
its `forward`; DDP and FSDP see those calls because Lightning routes each one through the
wrapper's `forward` (`_ForwardRedirection`). The hooks `initialize` puts on its root
module need the same (the input cast, fp16's loss scaling, stage 3's root unit, which
holds every parameter outside a block), and must run once per step, not again for every
`self(x)` inside it. So the engine is built on `EngineRoot`, a module that holds the
user's module and whose `forward` calls it, and the strategies route step calls through
it as Lightning routes them through DDP. Its child is named `_orig_mod`, the segment
zeroshard drops from names as it does for a torch.compile wrapper (zeroshard.ckpt's
`canonical_name`), so parameters keep the user module's own names in checkpoints,
consolidated weights and `full_state_dict`.

The user's module gets a `zeroshard_module` attribute naming its root, outside its module
tree (the root holds the module, not the other way round). The engine's functions take
the module so marked (`WrapsEngineModel`): `zs.full_state_dict(lightning_module)`; and a
second Trainer, or a second `fit`, finds the engine already built on it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zeroshard.engine.config._config import ZeroConfig
from zeroshard.engine.config._policies import OffloadPolicy
from zeroshard.engine.runtime._optimizer import ZeroOptimizer
from zeroshard.engine.runtime._state import engine_state
from zeroshard.engine.setup._initialize import initialize

_MARK = "zeroshard_module"


class EngineRoot(nn.Module):
    """The engine's model: the user's module as its only child (see [Note: the engine's
    root]), with what the strategies built it with."""

    def __init__(self, module: nn.Module, config: ZeroConfig) -> None:
        super().__init__()
        self._orig_mod = module
        self.config = config
        self.schedulers: list[Any] = []
        """The Trainer's LR scheduler configs, for a later `fit` on the same engine."""

    @property
    def optimizer(self) -> ZeroOptimizer | None:
        """The engine's optimizer; None where it was built for evaluation only."""
        return engine_state(self).optimizer

    @property
    def eval_only(self) -> bool:
        """Built without the user's optimizer, for evaluation only."""
        return self.optimizer is None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The user's module called with the same arguments."""
        return self._orig_mod(*args, **kwargs)


def engine_root(module: nn.Module) -> EngineRoot | None:
    """The engine already built on `module` (or on the module `module` marks), if any."""
    if isinstance(module, EngineRoot):
        return module
    root = module.__dict__.get(_MARK)
    return root if isinstance(root, EngineRoot) else None


def build_engine(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    config: ZeroConfig,
) -> EngineRoot:
    """Shard `module` and `optimizer` (fresh, on its parameters) with `config`; without an
    optimizer, for evaluation only (a later fit on it is refused: see `reuse_engine`)."""
    root = EngineRoot(module, config)
    if optimizer is None:
        # CPU offload is of an optimizer's state and step, which initialize() refuses
        # without one; the strategies named `..._offload` evaluate with the rest of theirs.
        initialize(root, None, config.replace(offload=OffloadPolicy()))
    else:
        initialize(root, optimizer, config)
    object.__setattr__(module, _MARK, root)  # outside the module tree: no cycle in it
    return root


def reuse_engine(module: nn.Module, config: ZeroConfig, *, training: bool) -> EngineRoot | None:
    """The engine built on `module` before, if any, checked against this run's config;
    ValueError where it cannot serve (another config, or training on an evaluation-only
    engine)."""
    root = engine_root(module)
    if root is None:
        return None
    if root.config != config:
        raise ValueError(
            f"zeroshard: {type(module).__name__} was sharded before with another config "
            f"({root.config.to_dict()}); this strategy's is {config.to_dict()}. A module is "
            "sharded once: build a fresh module for another config"
        )
    if training and root.eval_only:
        raise ValueError(
            f"zeroshard: {type(module).__name__} was sharded for evaluation only (validate, "
            "test or predict ran first, without an optimizer); training needs the optimizer "
            "at sharding time: fit first, or build a fresh module to train"
        )
    return root
