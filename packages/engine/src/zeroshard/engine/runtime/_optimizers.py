"""Several torch optimizers over disjoint parameters, seen as one (`CombinedOptimizer`).

torch's own recipe for Muon is two optimizers: Muon on the hidden matrices, AdamW on
the rest. `initialize` takes such a sequence and wraps one optimizer, so it combines
them: the combined optimizer's `param_groups` list every optimizer's param groups in
turn (the same dicts, so an LR scheduler's writes reach them), and its param group k is
what `GroupKey.param_group` k names. Its `state` reads through to each optimizer's own
(`OptimizersState`: their keys are disjoint tensors), so what the engine reads and
writes through it reaches the optimizer that steps the parameter, and each optimizer's
`state` stays its own, as torch's `state_dict`, `load_state_dict` and `step` expect.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from typing import Any

import torch
from torch import nn


class OptimizersState(MutableMapping[torch.Tensor, Any]):
    """Several optimizers' `state` as one mapping, read and written through to each one's
    own (looked up at every access: torch's `load_state_dict` replaces it). A parameter
    not yet in any reads as an empty entry of the optimizer that steps it, as torch's
    `state` (a `defaultdict`) gives; a tensor none of them steps (a frozen group's master)
    gets an entry of this mapping's own, as one optimizer's `state` would hold it, which
    no optimizer's `state_dict` holds."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self._optimizers = list(optimizers)
        self._others: defaultdict[torch.Tensor, Any] = defaultdict(dict)

    def _states(self) -> Iterator[MutableMapping[torch.Tensor, Any]]:
        yield from (o.state for o in self._optimizers)
        yield self._others

    def _holding(self, key: object) -> MutableMapping[torch.Tensor, Any] | None:
        return next((s for s in self._states() if key in s), None)

    def _of(self, key: torch.Tensor) -> MutableMapping[torch.Tensor, Any]:
        """The state that holds `key`'s entry, else that of the optimizer stepping it."""
        held = self._holding(key)
        if held is not None:
            return held
        for o in self._optimizers:
            if any(p is key for pg in o.param_groups for p in pg["params"]):
                return o.state
        return self._others

    def __getitem__(self, key: torch.Tensor) -> Any:
        return self._of(key)[key]

    def __setitem__(self, key: torch.Tensor, value: Any) -> None:
        self._of(key)[key] = value

    def __delitem__(self, key: torch.Tensor) -> None:
        held = self._holding(key)
        if held is None:
            raise KeyError(key)
        del held[key]

    def __contains__(self, key: object) -> bool:
        return self._holding(key) is not None

    def __iter__(self) -> Iterator[torch.Tensor]:
        return itertools.chain.from_iterable(self._states())

    def __len__(self) -> int:
        return sum(map(len, self._states()))

    def get(self, key: torch.Tensor, default: Any = None) -> Any:
        """The entry of `key` where one is held, else `default` (none is made)."""
        held = self._holding(key)
        return default if held is None else held[key]

    def pop(self, key: torch.Tensor, *default: Any) -> Any:
        """Remove and return the entry of `key`; `default` where none is held."""
        held = self._holding(key)
        if held is not None:
            return held.pop(key)
        if default:
            return default[0]
        raise KeyError(key)


class CombinedOptimizer(torch.optim.Optimizer):
    """`optimizers` as one: their param groups in turn, their states read through one
    `state` (`OptimizersState`), each stepped in turn by `step()`; `state_dict()` holds
    one state dict per optimizer."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)
        # Optimizer.__init__ sets up the hook tables; its own param groups are replaced.
        super().__init__(
            [p for o in self.optimizers for pg in o.param_groups for p in pg["params"]], {}
        )
        self._list_param_groups()
        # torch types `state` as the defaultdict it makes; this one reads through to them.
        self.state = OptimizersState(self.optimizers)  # type: ignore[assignment]

    def _list_param_groups(self) -> None:
        """Every optimizer's param groups in turn (after construction, and after a load,
        which gives each optimizer new ones)."""
        self.param_groups = [pg for o in self.optimizers for pg in o.param_groups]

    def offsets(self) -> list[int]:
        """The index in `param_groups` of each optimizer's first param group."""
        out, k = [], 0
        for o in self.optimizers:
            out.append(k)
            k += len(o.param_groups)
        return out

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step every optimizer in turn."""
        if closure is not None:
            raise ValueError("CombinedOptimizer.step does not take a closure")
        for o in self.optimizers:
            o.step()
        return None

    def state_dict(self) -> dict[str, Any]:
        """One torch state dict per optimizer, in order."""
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load `state_dict()` output, one optimizer at a time, with this optimizer's own
        load hooks around it as torch's load runs them."""
        saved = state_dict.get("optimizers")
        if not isinstance(saved, list) or len(saved) != len(self.optimizers):
            got = len(saved) if isinstance(saved, list) else "no"
            raise ValueError(
                f"the state dict holds {got} optimizer state(s), this combines "
                f"{len(self.optimizers)}: was it saved with other optimizers?"
            )
        for pre in self._optimizer_load_state_dict_pre_hooks.values():
            changed = pre(self, state_dict)
            state_dict = changed if changed is not None else state_dict
        for o, s in zip(self.optimizers, state_dict["optimizers"], strict=True):
            o.load_state_dict(s)
        self._list_param_groups()
        for post in self._optimizer_load_state_dict_post_hooks.values():
            post(self)


def stepped_by(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizer that steps each of `optimizer`'s param groups, in order: itself, or
    for a `CombinedOptimizer` the one of those it combines that holds the group."""
    if not isinstance(optimizer, CombinedOptimizer):
        return [optimizer] * len(optimizer.param_groups)
    return [o for o in optimizer.optimizers for _ in o.param_groups]


def class_path(o: object) -> str:
    """`o`'s class as `module.QualName` (`torch.optim.adamw.AdamW`)."""
    return f"{type(o).__module__}.{type(o).__qualname__}"


def as_optimizers(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    model: nn.Module | None = None,
) -> list[torch.optim.Optimizer]:
    """The optimizers `initialize` was given, checked: at least one, each a torch
    optimizer, no parameter in two of them (named by its name in `model`)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    optimizers = list(optimizer)
    if not optimizers:
        raise ValueError(
            "initialize() needs an optimizer (or a sequence of them), got none (pass None "
            "to shard the model for evaluation only)"
        )
    if all(isinstance(o, torch.Tensor) for o in optimizers):
        # `initialize(model, model.parameters(), cfg)`: the parameters, not an optimizer.
        raise TypeError(
            f"initialize() was given {len(optimizers)} tensors (the model's parameters?) "
            "where it takes the optimizer built on them: pass "
            "torch.optim.AdamW(model.parameters(), lr=...) (any torch.optim optimizer), "
            "or a list of optimizers over disjoint parameters"
        )
    for i, o in enumerate(optimizers):
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(f"optimizer {i} is a {type(o).__name__}, not a torch.optim.Optimizer")
    names = {} if model is None else {id(p): n for n, p in model.named_parameters()}
    seen: dict[int, int] = {}
    for i, o in enumerate(optimizers):
        for p in (p for pg in o.param_groups for p in pg["params"]):
            if seen.setdefault(id(p), i) != i:
                what = names.get(id(p), f"a parameter of shape {tuple(p.shape)}")
                raise ValueError(
                    f"{what} is in optimizer {seen[id(p)]} "
                    f"({type(optimizers[seen[id(p)]]).__name__}) and in optimizer {i} "
                    f"({type(o).__name__}): each parameter belongs to one optimizer"
                )
    return optimizers


def combine(optimizers: Sequence[torch.optim.Optimizer]) -> torch.optim.Optimizer:
    """The one optimizer itself, or several as a `CombinedOptimizer`."""
    return optimizers[0] if len(optimizers) == 1 else CombinedOptimizer(optimizers)
