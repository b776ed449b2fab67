"""Which optimizers step whole parameters, and how.

[Note: whole-matrix optimizers]
A flat group's shard cuts parameters anywhere, which elementwise optimizers (AdamW) do
not mind. Muon, Shampoo, SOAP and Dion update a weight matrix as a whole, so each
matrix of theirs is stepped by one rank of its flat group's process group, its owner
(`_owners.py`), and its pieces travel between the shards and the owner (`_exchange.py`).

- `torch.optim.Muon` itself (by exact type, where torch has the functions behind its
  step that `MuonStep` calls; else as a declared one) is stepped by `MuonStep` (`_muon.py`):
  momentum, the Nesterov blend, weight decay and the add run on every rank's shard,
  elementwise, and only the blended update goes to the owner, in bf16 (the dtype
  Newton-Schulz starts with), which orthogonalizes it and sends the result back.
- An optimizer that declares `zeroshard_whole_params = True` (a class or instance
  attribute), or a subclass of Muon (whose step may differ), is stepped by
  `WholeParamStep` (`_whole_step.py`): the owner gets the full fp32 gradient and master,
  runs the optimizer's own `step()` on them, and sends the new master back. Its step must
  skip parameters whose `grad` is None, as torch's optimizers do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

WHOLE_PARAMS = "zeroshard_whole_params"


class MuonFunctions(NamedTuple):
    """torch.optim.Muon's own Newton-Schulz and learning-rate adjustment."""

    newton_schulz: Callable[..., torch.Tensor]
    adjusted_lr: Callable[..., float]


def muon_functions() -> MuonFunctions | None:
    """torch's functions behind torch.optim.Muon's step (private to torch: `MuonStep`
    calls them so that its bits are torch's), or None where this torch lacks one."""
    try:
        from torch.optim import _muon
    except ImportError:
        return None
    ns: Any = getattr(_muon, "_zeropower_via_newtonschulz", None)
    lr: Any = getattr(_muon, "_adjust_lr", None)
    return MuonFunctions(ns, lr) if callable(ns) and callable(lr) else None


def torch_muon() -> type[torch.optim.Optimizer] | None:
    """torch.optim.Muon where this torch has it (2.9 on)."""
    muon: Any = getattr(torch.optim, "Muon", None)
    return muon if isinstance(muon, type) else None


def steps_whole(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` needs whole parameters (see [Note: whole-matrix optimizers])."""
    muon = torch_muon()
    return bool(getattr(optimizer, WHOLE_PARAMS, False)) or (
        muon is not None and isinstance(optimizer, muon)
    )


def split_muon(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is torch.optim.Muon itself, stepped by `MuonStep`."""
    muon = torch_muon()
    return (
        muon is not None
        and type(optimizer) is muon
        and not getattr(optimizer, WHOLE_PARAMS, False)
        and muon_functions() is not None
    )
