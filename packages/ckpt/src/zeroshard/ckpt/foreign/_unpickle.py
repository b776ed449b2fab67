"""Load DeepSpeed's torch pickles without running code from them.

DeepSpeed checkpoints are `torch.save` pickles. We read them with
`torch.load(weights_only=True)`, whose unpickler builds only tensors, containers and
primitives, plus the few globals named in `DEEPSPEED_GLOBALS`, allowed for the duration
of the call only. Those globals are inert stand-ins defined here (DeepSpeed need not be
installed): attribute bags for DeepSpeed's small records, an int enum for its ZeRO stage.
A pickle that asks for any other global (`os.system`, `builtins.eval`, a DeepSpeed class
we do not know) is refused with `UnsafePickleError` naming it, before anything in it runs.
"""

from __future__ import annotations

import _compat_pickle
import contextlib
import enum
import io
import pickle
import re
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from zeroshard.ckpt._errors import CheckpointError


class UnsafePickleError(CheckpointError):
    """A pickle asked for something outside the allowlist; nothing in it was executed.

    `global_name` is the refused global (`"posix.system"`), or None when the unpickler
    refused something else (an opcode or a call), described in the message.
    """

    def __init__(self, path: Path, global_name: str | None, detail: str = "") -> None:
        if global_name is not None:
            what = (
                f"it asks for the global {global_name!r}, which is not one DeepSpeed or DCP "
                "checkpoints need (allowed: tensors, containers, primitives and, in DeepSpeed's "
                f"files, {', '.join(name for _, name in DEEPSPEED_GLOBALS)})"
            )
        else:
            what = detail
        super().__init__(f"{path}: refused to unpickle: {what}. Nothing in the file was run.")
        self.path = path
        self.global_name = global_name


class CorruptFileError(CheckpointError):
    """A checkpoint file is truncated, not a torch zip file, or otherwise unreadable."""


class _Record:
    """An inert attribute bag standing in for a small DeepSpeed object (state set by BUILD)."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class LossScaler(_Record):
    """Stand-in for `deepspeed.runtime.fp16.loss_scaler.LossScaler` (its attributes only)."""


class DynamicLossScaler(_Record):
    """Stand-in for `deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler`."""


class FragmentAddress(_Record):
    """Stand-in for `deepspeed.utils.tensor_fragment.fragment_address` (numel, start)."""


class ZeroStage(enum.IntEnum):
    """Stand-in for `deepspeed.runtime.zero.config.ZeroStageEnum`, pickled as `Enum(value)`."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


# (stand-in, the global's full name in DeepSpeed's pickles). Keep this list minimal: every
# entry is something an untrusted file may construct.
DEEPSPEED_GLOBALS: tuple[tuple[Callable[..., Any], str], ...] = (
    (LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
    (ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
)

_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")


def _canonical(name: str) -> str:
    """The global as Python 3 names it: torch drops `builtins.`, and protocol-2 pickles
    (torch.save's) spell some modules the Python 2 way (`commands` for `subprocess`)."""
    module, _, attr = name.rpartition(".")
    if not module:
        return f"builtins.{attr}"
    if (module, attr) in _compat_pickle.NAME_MAPPING:
        module, attr = _compat_pickle.NAME_MAPPING[(module, attr)]
    return f"{_compat_pickle.IMPORT_MAPPING.get(module, module)}.{attr}"


def _refusal(message: str) -> str:
    """The specific line of torch's weights_only refusal, without its generic advice."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    specific = [
        ln
        for ln in lines
        if not ln.startswith(("Weights only load failed", "Check the documentation", "(1)", "(2)"))
        and "weights_only" not in ln
    ]
    return specific[0] if specific else (lines[0] if lines else "unpickling refused")


def load_torch_file(path: Path, *, mmap: bool = True) -> Any:
    """`torch.load` a DeepSpeed file with weights_only=True and only DeepSpeed's globals allowed.

    With `mmap=True` tensors stay memory-mapped: nothing of their data is read until used.
    """
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint file")
    # torch.save's zip format keeps its central directory at the end: a truncated file
    # fails here, before the unpickler sees it.
    if not zipfile.is_zipfile(path):
        raise CorruptFileError(
            f"{path}: not a torch zip-format file (truncated, corrupt, or saved with the "
            "legacy non-zip serialization)"
        )
    allowed: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = list(DEEPSPEED_GLOBALS)
    with torch.serialization.safe_globals(allowed), _refusals(path):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def load_torch_bytes(data: bytes, where: str) -> Any:
    """`torch.load` one `torch.save` archive held in memory (a DCP checkpoint's non-tensor
    entry) with weights_only=True and no extra globals; `where` names it in errors."""
    with _refusals(Path(where)):
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


@contextlib.contextmanager
def _refusals(path: Path) -> Iterator[None]:
    """torch.load's failures as `UnsafePickleError` (naming the global asked for, never
    the advice to retry with weights_only=False) or `CorruptFileError`."""
    try:
        yield
    except pickle.UnpicklingError as e:
        detail = _refusal(str(e))
        match = _GLOBAL_RE.search(detail)
        raise UnsafePickleError(
            path, _canonical(match.group(1)) if match else None, detail
        ) from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CorruptFileError(f"{path}: unreadable torch file (truncated?): {first}") from e
