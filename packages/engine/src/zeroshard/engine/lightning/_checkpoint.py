"""Lightning checkpoints in zeroshard's format: sharded state plus Lightning's own, no pickle.

[Note: a Lightning checkpoint on disk]
`trainer.save_checkpoint(path)`, `ModelCheckpoint` and `fabric.save(path, state)` write a
directory at `path` (Lightning's `.ckpt` name kept, as its DeepSpeed strategy does): a
zeroshard checkpoint root holding `checkpoint/` (each rank's shards of the masters
and of the optimizer state, with their layouts, so any number of ranks loads it and
`zeroshard-ckpt consolidate PATH OUT` writes full safetensors) and the `latest` pointer
naming it. Saving again over the same path (`last.ckpt`) replaces it atomically.

What Lightning adds (epoch, global step, loop progress, callbacks' state, LR schedulers,
hyperparameters, what `on_save_checkpoint` puts in) is the checkpoint's global client
state (rank 0's), stored as plain data, not pickled: loading it runs no code, and a value
that is not plain data (None, bool, int, float, str, lists, tuples, dicts, tensors) is
refused, by name, on every rank before anything is written. Lightning's `state_dict` and
`optimizer_states` entries are left out: the shards hold both.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zeroshard.engine.lightning._engine import EngineRoot
from zeroshard.engine.state._checkpoint import load_checkpoint, save_checkpoint

TAG = "checkpoint"
"""The checkpoint's name inside the directory a Lightning path names."""

_CLIENT_KEY = "lightning"
SHARDED_KEYS = ("state_dict", "optimizer_states")
"""The entries of the Trainer's checkpoint dict that the shards hold instead."""


def save_sharded(
    root: EngineRoot, path: str | os.PathLike[str], state: Mapping[str, Any], step: int
) -> None:
    """Write `root`'s engine and Lightning's `state` (plain data) as the checkpoint `path`
    (collective)."""
    save_checkpoint(
        root,
        root.optimizer,
        Path(path),
        step=step,
        tag=TAG,
        overwrite=True,
        client_state={_CLIENT_KEY: dict(state)},
    )


def load_sharded(root: EngineRoot, path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load the checkpoint `path` into `root`'s engine, saved at any world size; Lightning's
    state saved with it (collective)."""
    client: dict[str, Any] = {_CLIENT_KEY: None}
    # An evaluation-only engine (no optimizer) loads the weights alone.
    load_checkpoint(root, root.optimizer, Path(path), client_state=client)
    loaded: dict[str, Any] = client[_CLIENT_KEY]
    return loaded
