"""Stage 3 units: which modules' parameters are gathered and released together.

Policy, top down from the root:
- a module named or typed in `leaf_modules` (or, when `leaf_params_per_module` is set,
  one whose parameters per descendant module fall under it) is a unit and nothing below
  it is: its whole subtree is fetched with one collective and released at once, so
  experts that run on some ranks and not others never issue collectives of their own;
- a module named or typed in `unit_modules` is a unit (units may nest);
- without `unit_modules`, each element of an `nn.ModuleList`, `nn.ModuleDict` or
  `nn.Sequential` holding at least `min_unit_params` parameters is a unit (the
  transformer blocks), outermost only;
- the root is a unit for every parameter left over.
A parameter belongs to the innermost unit around its module; a parameter used under
several names (tied weights) belongs to the innermost unit around all of its modules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from zeroshard.engine.config._policies import Stage3Policy
from zeroshard.engine.runtime._names import canonical_name

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


@dataclass(frozen=True)
class UnitPlan:
    """A unit: its module path ('' for the root), module, and the parameters it owns."""

    name: str
    module: nn.Module
    params: tuple[tuple[str, nn.Parameter], ...]
    leaf: bool


def is_persistent(index: int, numel: int, persistence_threshold: int) -> bool:
    """Whether unit `index` of `numel` parameter elements stays gathered for the whole step:
    the root and every unit under `persistence_threshold` elements."""
    # The root stays gathered: its forward wraps every other unit's, and its output layer
    # is the first thing backward needs.
    return index == 0 or numel < persistence_threshold


def _matches(names: Sequence[str], path: str, module: nn.Module) -> bool:
    return path in names or type(module).__name__ in names


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _auto_leaf(module: nn.Module, threshold: int) -> bool:
    descendants = sum(1 for _ in module.modules()) - 1
    return threshold > 0 and descendants >= 2 and _numel(module) / descendants < threshold


def plan_units(model: nn.Module, policy: Stage3Policy) -> list[UnitPlan]:
    """The units of `model` in registration order (the root first); see the module doc."""
    unit_modules, leaf_modules = policy.unit_modules, policy.leaf_modules
    min_unit_params, leaf_params_per_module = policy.min_unit_params, policy.leaf_params_per_module
    chosen: dict[str, tuple[nn.Module, bool]] = {"": (model, False)}

    def visit(prefix: str, module: nn.Module, in_default_unit: bool) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if _matches(leaf_modules, path, child) or _auto_leaf(child, leaf_params_per_module):
                chosen[path] = (child, True)
                continue
            default = (
                not unit_modules
                and not in_default_unit
                and isinstance(module, _CONTAINERS)
                and _numel(child) >= min_unit_params
            )
            if default or _matches(unit_modules, path, child):
                chosen[path] = (child, False)
            visit(f"{path}.", child, in_default_unit or default)

    visit("", model, False)
    missing = [n for n in (*unit_modules, *leaf_modules) if not _named_anywhere(model, n)]
    if missing:
        raise ValueError(f"unit/leaf modules {missing} match no module name or class of the model")

    def owner(param_path: str) -> str:
        module_path = param_path.rpartition(".")[0]
        best = ""
        for unit in chosen:
            if unit and (module_path == unit or module_path.startswith(unit + ".")):
                best = max(best, unit, key=len)
        return best

    owners: dict[int, str] = {}
    first_name: dict[int, tuple[str, nn.Parameter]] = {}
    for path, p in model.named_parameters(remove_duplicate=False):
        unit = owner(path)
        if id(p) in owners:
            owners[id(p)] = _common_unit(owners[id(p)], unit, chosen)
        else:
            owners[id(p)] = unit
            first_name[id(p)] = (canonical_name(path), p)
    plans = []
    for unit, (module, leaf) in chosen.items():
        params = tuple(first_name[i] for i, u in owners.items() if u == unit)
        if params or unit == "":
            plans.append(UnitPlan(unit, module, params, leaf))
    return plans


def _named_anywhere(model: nn.Module, name: str) -> bool:
    return any(path == name or type(m).__name__ == name for path, m in model.named_modules())


def _common_unit(a: str, b: str, units: dict[str, tuple[nn.Module, bool]]) -> str:
    """The innermost unit that contains both unit paths."""
    pa, pb = a.split("."), b.split(".")
    common: list[str] = []
    for x, y in zip(pa, pb, strict=False):
        if x != y:
            break
        common.append(x)
    while common and ".".join(common) not in units:
        common.pop()
    return ".".join(common)
