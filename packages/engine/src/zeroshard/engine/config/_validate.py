"""Exact value checks shared by the config policies and the DeepSpeed translation.

Each check names the setting and what it allows. A bool is never taken for a number
(`True` is an int to Python, not to a config), and a float is never taken for an int.
"""

from __future__ import annotations

import difflib
import math
import reprlib
from collections.abc import Iterable
from typing import Any

import torch

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# reprlib stops at a depth and a length, so a deeply nested or huge value still gives a
# short message (plain repr of a 10,000-deep dict raises RecursionError).
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxdict, _SHORT.maxlist, _SHORT.maxstring, _SHORT.maxother = 3, 4, 4, 60, 60


def shown(value: Any) -> str:
    """`value` as an error message shows it: a short repr and its type."""
    return f"{_SHORT.repr(value)} ({type(value).__name__})"


def check_int(name: str, value: Any, *, minimum: int) -> int:
    """An int (not a bool, not a float) of at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        wanted = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {wanted}, got {shown(value)}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """True or False, nothing that merely converts to one."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {shown(value)}")
    return value


def check_positive_float(name: str, value: Any) -> float:
    """A finite number > 0 (an int or a float, not a bool), as a float."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not value > 0
    ):
        raise ValueError(f"{name} must be a finite number > 0, got {shown(value)}")
    return float(value)


def check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    """One of the strings `allowed`."""
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {shown(value)}")
    return value


def check_names(name: str, value: Any) -> tuple[str, ...]:
    """A list or tuple of strings (module or class names), as a tuple."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{name} must be a list of module or class names, got {shown(value)}")
    return tuple(value)


def parse_dtype(value: Any, what: str) -> torch.dtype:
    """A dtype from 'bf16' / 'fp16' / 'fp32' (or long names) or a torch dtype."""
    if isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str) and value.lower() in _DTYPE_NAMES:
        dtype = _DTYPE_NAMES[value.lower()]
    else:
        raise ValueError(
            f"{what}: {shown(value)} is not a dtype; use one of 'fp32', 'bf16', 'fp16'"
        )
    if dtype not in _COMPUTE_DTYPES:
        raise ValueError(f"{what}: {dtype} is not supported; use fp32, bf16 or fp16")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The short name 'fp32' / 'bf16' / 'fp16' of a supported dtype."""
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def unknown_keys_error(
    what: str,
    unknown: Iterable[str],
    valid: Iterable[str],
    path: str = "",
    other: tuple[str, Iterable[str]] = ("", ()),
) -> ValueError:
    """The error for keys nobody reads: lists them (under `path`), a close match for each, and
    the valid ones; `other` is (a description, keys) of another accepted spelling."""
    valid = sorted(valid)
    other_text, other_keys = other[0], sorted(other[1])
    hints = []
    for key in sorted(unknown):
        close = difflib.get_close_matches(key, [*valid, *other_keys], n=1)
        named = repr(path + key)
        hints.append(f"{named} (did you mean {close[0]!r}?)" if close else named)
    tail = f" (or {other_text}: {other_keys})" if other_keys else ""
    return ValueError(f"unknown {what} {', '.join(hints)}; valid keys: {valid}{tail}")
