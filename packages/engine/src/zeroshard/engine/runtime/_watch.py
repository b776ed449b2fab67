"""`ChangeWatch`: the model and optimizer `initialize` built the engine on, checked
at each forward and step.

[Note: changes after initialize]
`initialize` builds the engine on the model and optimizer as they are: which parameters
exist and which train (their flat groups, masters, gradient hooks and stage-3 units) and
which param groups the optimizer has (bound to the masters). A change afterwards would
go unseen and train silently wrong: a parameter unfrozen (`requires_grad=True`) or added
by `add_param_group` would never train (it has no master), one frozen would go on being
stepped, a module converted (torchao's `convert_to_float8_training`), replaced or added
would compute with parameters the engine does not publish. So:

- `add_param_group` after `initialize`, on the `ZeroOptimizer` or on an optimizer it
  wraps, raises at the call: sharding parameters after the fact would need the engine
  built again.
- A module or parameter assigned into the model (torch's global registration hooks see
  every `setattr`, `add_module`, `register_parameter`), a flipped `requires_grad`, or a
  param group added or given other parameters by hand raise at the model's next forward
  (a pre-hook of the root module) or `step()`, naming the change and what to do.
  Assigning the object already there, or a module without parameters where none were
  (an activation), is no change the engine needs to follow; putting back what was there
  at `initialize` undoes the change.
- A parameter set to None or deleted (no registration hook sees that), or converted to
  another dtype (`model.half()`, `.to(dtype)`: the engine publishes into the buffers it
  built, in its compute dtype) raises at the next forward or `step()` too.

Each rank checks its own model: in a script that changes the model on every rank alike,
every rank raises the same error. The cost per forward and step is one read of each
parameter's `requires_grad`, dtype and registration and of each param group's
parameter list (docs/reliability.md, 4); assignments cost nothing until they happen.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from zeroshard.engine.runtime._flat_group import FlatParamGroup
from zeroshard.engine.runtime._hooks import prepend_forward_pre_hook

_REBUILD = (
    "the engine is built at zeroshard.engine.initialize() on the model and optimizer as "
    "they are then (flat groups, masters, gradient hooks, stage-3 units), and sharding "
    "parameters after the fact would mean building it again"
)
_UNFREEZE = (
    "To unfreeze parameters later (gradual unfreezing), build the optimizer with every "
    "parameter you will train, each group to be unfrozen in a param group of its own with "
    "lr=0 (requires_grad=True throughout), and set that group's lr when you unfreeze it"
)
ADD_PARAM_GROUP = (
    f"add_param_group after zeroshard.engine.initialize() is not supported: {_REBUILD}. "
    f"{_UNFREEZE}."
)

_requires_grad = operator.attrgetter("requires_grad")
_dtype = operator.attrgetter("dtype")
# Every module of every watched model -> its model's watch (weakly: the watch reaches the
# modules through the engine, and a value that holds its key keeps it alive for ever) and
# its path there.
_WATCHED: weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref[ChangeWatch], str]] = (
    weakref.WeakKeyDictionary()
)
_HOOKS: list[Any] = []


class ChangeWatch:
    """What `initialize` built the engine on (see [Note: changes after initialize])."""

    def __init__(
        self,
        model: nn.Module,
        groups: Sequence[FlatParamGroup],
        optimizers: Sequence[torch.optim.Optimizer],
    ) -> None:
        named = [(n, p) for g in groups for n, p in zip(g.names, g.params, strict=True)]
        self._names = [n for n, _ in named]
        self._params = tuple(p for _, p in named)
        self._trainable = tuple(map(_requires_grad, self._params))
        self._dtypes = tuple(map(_dtype, self._params))
        # Where each watched parameter is registered (every name of a tied one): set to
        # None or deleted, it is gone without passing the registration hooks.
        watched = {id(p) for p in self._params}
        self._slots = [
            (m._parameters, n, _path(path, n), p)
            for path, m in model.named_modules(remove_duplicate=False)
            for n, p in m._parameters.items()
            if p is not None and id(p) in watched
        ]
        self._optimizers = list({id(o): o for o in optimizers}.values())
        self._param_lists = self._param_groups()
        # (module, "module" or "parameter", name) -> what was there, and what changed.
        self._moved: dict[tuple[int, str, str], tuple[object, str]] = {}
        for path, module in model.named_modules():
            _WATCHED[module] = (weakref.ref(self), path)
        if not _HOOKS:
            _HOOKS.append(register_module_module_registration_hook(_module_assigned))
            _HOOKS.append(register_module_parameter_registration_hook(_parameter_assigned))
        for o in self._optimizers:
            o.add_param_group = _RefuseAddParamGroup()  # type: ignore[method-assign]

        # A function, not a bound method: a deepcopy of the model (an EMA) copies no watch.
        def before_forward(module: nn.Module, args: Any) -> None:
            # Not while torch.compile traces the forward: the step checks compiled models.
            if not torch.compiler.is_compiling():
                self.check("the model's forward")

        # First, before anything of the forward reads a parameter.
        prepend_forward_pre_hook(model, before_forward)

    def _param_groups(self) -> list[tuple[int, list[tuple[list[Any], int]]]]:
        # By the params lists themselves: torch's load_state_dict makes new group dicts
        # (and a new list of them) but keeps each group's params list.
        return [
            (len(o.param_groups), [(pg["params"], len(pg["params"])) for pg in o.param_groups])
            for o in self._optimizers
        ]

    def assigned(
        self, module: nn.Module, kind: str, name: str, old: object, new: object, what: str
    ) -> None:
        """`new` is put where `old` is, in `module`: a change the engine cannot follow,
        undone when what was there at `initialize` is put back."""
        key = (id(module), kind, name)
        original, _ = self._moved.setdefault(key, (old, what))
        if new is original:
            del self._moved[key]

    def check(self, where: str, *, param_lists: bool = True) -> None:
        """RuntimeError naming the first change since `initialize` (none: nothing).
        `param_lists`: compare each param group's parameter list too, not only their
        number (not at `step()`: offload's step in backward may still be stepping one
        group alone, its params list swapped, until the step drains it)."""
        if self._moved:
            change = next(iter(self._moved.values()))[1]
            raise RuntimeError(
                f"{change} after zeroshard.engine.initialize() (found at {where}): "
                f"{_REBUILD}. Make the change before initialize() (convert, replace or add "
                "modules first), or save a checkpoint and initialize the changed model anew"
            )
        if tuple(map(_requires_grad, self._params)) != self._trainable:
            self._requires_grad_flipped(where)
        for registered, leaf, name, p in self._slots:
            if registered.get(leaf) is not p:
                self._parameter_removed(name, where)
        if tuple(map(_dtype, self._params)) != self._dtypes:
            self._dtype_changed(where)
        if self._groups_changed(param_lists):
            raise RuntimeError(
                f"the optimizer's param groups changed after zeroshard.engine.initialize() "
                f"(found at {where}: a group added, or parameters put in or taken out of one): "
                f"{_REBUILD}. {_UNFREEZE}"
            )

    def _groups_changed(self, param_lists: bool) -> bool:
        for o, (n, lists) in zip(self._optimizers, self._param_lists, strict=True):
            if len(o.param_groups) != n:
                return True
            if not param_lists:
                continue
            for pg, (ps, k) in zip(o.param_groups, lists, strict=True):
                if pg["params"] is not ps or len(ps) != k:
                    return True
        return False

    def _parameter_removed(self, name: str, where: str) -> None:
        raise RuntimeError(
            f"parameter {name!r} was removed (set to None or deleted) after "
            f"zeroshard.engine.initialize() (found at {where}): {_REBUILD}. Freeze it "
            "instead (its param group's lr and weight_decay at 0), or save a checkpoint and "
            "initialize the changed model anew"
        )

    def _dtype_changed(self, where: str) -> None:
        name, was, now = next(
            (n, was, p.dtype)
            for n, p, was in zip(self._names, self._params, self._dtypes, strict=True)
            if p.dtype != was
        )
        raise RuntimeError(
            f"parameter {name!r} was {was} at zeroshard.engine.initialize() and is {now} "
            f"now (found at {where}: model.half(), .to(dtype) or p.data = ...): the engine "
            "computes in the dtype its config names and publishes into the buffers it built "
            "then. Set precision.compute_dtype (compute_dtype) instead, and convert the "
            "model before initialize(), if at all"
        )

    def _requires_grad_flipped(self, where: str) -> None:
        for name, p, was in zip(self._names, self._params, self._trainable, strict=True):
            if p.requires_grad == was:
                continue
            if p.requires_grad:
                raise RuntimeError(
                    f"parameter {name!r} was frozen (requires_grad=False) at "
                    f"zeroshard.engine.initialize() and requires grad now (found at {where}): "
                    f"it has no master nor optimizer state, so it would not train; {_REBUILD}. "
                    f"{_UNFREEZE}"
                )
            raise RuntimeError(
                f"parameter {name!r} was trainable at zeroshard.engine.initialize() and has "
                f"requires_grad=False now (found at {where}): the engine would go on stepping "
                "it (its momentum, its weight decay), as torch would not. To stop training it, "
                "set its param group's lr and weight_decay to 0; to train another set of "
                "parameters, initialize the model anew with them trainable"
            )


def _path(parent: str, name: str) -> str:
    return f"{parent}.{name}" if parent else name


def _has_parameters(module: nn.Module | None) -> bool:
    return module is not None and any(True for _ in module.parameters())


def _watch_of(module: nn.Module) -> tuple[ChangeWatch, str] | None:
    """The watch of the model `module` belongs to, and its path there (None: unwatched)."""
    watched = _WATCHED.get(module)
    watch = None if watched is None else watched[0]()
    return None if watch is None or watched is None else (watch, watched[1])


def _module_assigned(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    watched = _watch_of(module)
    if watched is None:
        return
    old = module._modules.get(name)
    if submodule is old:
        return
    watch, path = watched
    where = _path(path, name)
    if _has_parameters(old) or _has_parameters(submodule):
        if submodule is None:
            what = f"module {where!r} was removed"
        elif old is None:
            what = f"module {where!r} ({type(submodule).__name__}) was added"
        else:
            what = f"module {where!r} was replaced by a {type(submodule).__name__}"
        watch.assigned(module, "module", name, old, submodule, what)
    elif submodule is not None:
        # Nothing to shard: watch what it holds from now on.
        for sub, sub_module in submodule.named_modules(prefix=where):
            _WATCHED.setdefault(sub_module, (weakref.ref(watch), sub))


def _parameter_assigned(module: nn.Module, name: str, param: nn.Parameter) -> None:
    watched = _watch_of(module)
    old = module._parameters.get(name)
    if watched is None or old is param:
        return
    watch, path = watched
    what = f"parameter {_path(path, name)!r} was {'replaced' if old is not None else 'added'}"
    watch.assigned(module, "parameter", name, old, param, what)


class _RefuseAddParamGroup:
    """An optimizer's `add_param_group` after `initialize` (a class: picklable)."""

    def __call__(self, param_group: dict[str, Any]) -> None:
        raise ValueError(ADD_PARAM_GROUP)
