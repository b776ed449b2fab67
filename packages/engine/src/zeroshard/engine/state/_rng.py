"""`RNGState`: this process's random number generators as one `rank_state` entry."""

from __future__ import annotations

import random
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # NumPy is optional: without it there is no NumPy generator to keep
    np = None  # type: ignore[assignment]


class RNGState:
    """Saves and restores torch's CPU and CUDA generators, Python's `random` and NumPy's
    global generator. Per-rank state: pass it in `rank_state`, not `client_state`.

    Restoring them makes a resumed run draw the same dropout masks and shuffles as the
    uninterrupted one from the resume point on.
    """

    def state_dict(self) -> dict[str, Any]:
        """The generators' states now (CUDA's for every visible device, if initialized)."""
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "cuda": (
                torch.cuda.get_rng_state_all()
                if torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
                else []
            ),
            "python": random.getstate(),
            "numpy": None,
        }
        if np is not None:
            legacy = np.random.get_state(legacy=True)
            assert isinstance(legacy, tuple)  # legacy=True: (kind, keys, pos, has_gauss, cached)
            kind, keys, pos, has_gauss, cached = legacy
            state["numpy"] = {
                "kind": kind,
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Set every generator; a CUDA state saved on more devices than are visible fails."""
        cuda = list(state_dict["cuda"])
        if cuda:
            if len(cuda) > torch.cuda.device_count():
                raise ValueError(
                    f"RNGState holds {len(cuda)} CUDA generator state(s), this process "
                    f"sees {torch.cuda.device_count()} CUDA device(s)"
                )
            torch.cuda.set_rng_state_all(cuda)
        torch.set_rng_state(state_dict["torch"])
        random.setstate(state_dict["python"])
        n = state_dict["numpy"]
        if n is None or np is None:
            if n is not None:
                raise ValueError("RNGState holds a NumPy generator state; NumPy is not installed")
            return
        keys = n["keys"].numpy().astype(np.uint32)
        np.random.set_state(
            (str(n["kind"]), keys, int(n["pos"]), int(n["has_gauss"]), float(n["cached_gaussian"]))
        )
