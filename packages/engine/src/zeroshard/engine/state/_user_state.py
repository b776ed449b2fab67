"""The user's own state in a checkpoint: `client_state` (global) and `rank_state` (per rank).

[Note: user state]
A run depends on more than its model and optimizer: the learning-rate scheduler, where
the data loader is, the random number generators. `save_checkpoint` takes two mappings
of it, named by what they are to a restart:

- `client_state`, global state: one value for the whole job (the scheduler, an epoch
  counter). Every rank holds the same, so rank 0's is saved, and every rank loads it,
  at any world size.
- `rank_state`, per-rank state: each rank's own (its RNG states, its data position).
  Rank r's is saved with rank r's shards and given back to rank r. It has no meaning
  at another world size, so loading it there is refused (on every rank alike).

An entry is an object with `state_dict()` / `load_state_dict()` (DCP's `Stateful`, as
torch's schedulers and samplers have), whose state dict is stored and which loads in
place, or plain data (None, bool, int, float, str, lists, tuples, dicts, tensors),
which `load_checkpoint` puts back into the mapping it is given.

Stored without pickle (see [Note: extra state in the rank file] in zeroshard.ckpt): the
values become JSON, tensors are replaced by references to tensors stored in the rank's
safetensors file, and tuples and dicts that JSON cannot say as they are (keys other
than strings, or keys starting with '__') are tagged.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from zeroshard.ckpt import CheckpointError, RankExtra

GLOBAL = "client_state"
PER_RANK = "rank_state"
_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_ITEMS = "__items__"
_KINDS = "None, bool, int, float, str, list, tuple, dict, torch.Tensor"


@runtime_checkable
class Stateful(Protocol):
    """An object that saves and restores itself as a state dict (torch DCP's protocol)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class _Encoder:
    """Plain data to JSON values, collecting tensors under the names it gives them."""

    def __init__(self, scope: str) -> None:
        self.scope = scope
        self.tensors: dict[str, torch.Tensor] = {}

    def encode(self, value: Any, where: str) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, torch.Tensor):
            name = f"{self.scope}/{len(self.tensors)}"
            # A view would store its whole base; contiguous keeps only its own elements.
            self.tensors[name] = value.detach().contiguous()
            return {_TENSOR: name}
        if isinstance(value, list):
            return [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return {_TUPLE: [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, Mapping):
            if all(isinstance(k, str) and not k.startswith("__") for k in value):
                return {k: self.encode(v, f"{where}[{k!r}]") for k, v in value.items()}
            return {
                _ITEMS: [
                    [self.encode(k, f"{where} key {k!r}"), self.encode(v, f"{where}[{k!r}]")]
                    for k, v in value.items()
                ]
            }
        raise TypeError(
            f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which a "
            f"checkpoint cannot store: give plain data ({_KINDS}) or, at the top level, "
            "an object with state_dict() and load_state_dict()"
        )


def _decode(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if _TENSOR in value:
        return tensors[value[_TENSOR]]
    if _TUPLE in value:
        return tuple(_decode(v, tensors) for v in value[_TUPLE])
    if _ITEMS in value:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in value[_ITEMS]}
    return {k: _decode(v, tensors) for k, v in value.items()}


def encode_state(
    scopes: Mapping[str, Mapping[str, Any] | None],
) -> RankExtra | None:
    """This rank's extra state from the user's mappings by scope (GLOBAL, PER_RANK)."""
    doc: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    for scope, entries in scopes.items():
        if entries is None:
            continue
        enc = _Encoder(scope)
        doc[scope] = {}
        for key, value in entries.items():
            if not isinstance(key, str):
                raise TypeError(f"{scope} keys must be strings, got {key!r}")
            if isinstance(value, Stateful):
                value = value.state_dict()
            doc[scope][key] = enc.encode(value, f"{scope}[{key!r}]")
        tensors.update(enc.tensors)
    if not doc:
        return None
    return RankExtra(json.dumps(doc, allow_nan=True), tensors)


def saved_scope(extra: RankExtra | None, scope: str, where: str) -> dict[str, Any]:
    """The entries one scope of a saved extra holds, decoded; CheckpointError if none."""
    doc = None if extra is None else json.loads(extra.text).get(scope)
    if doc is None:
        raise CheckpointError(f"{where} holds no {scope} (it was saved without one)")
    assert extra is not None
    return {k: _decode(v, extra.tensors) for k, v in doc.items()}


def check_requested(saved: Mapping[str, Any], wanted: Mapping[str, Any], what: str) -> None:
    """CheckpointError naming the entries asked for that the checkpoint lacks."""
    missing = sorted(set(wanted) - set(saved))
    if missing:
        raise CheckpointError(
            f"{what} has no entr{'y' if len(missing) == 1 else 'ies'} {missing} "
            f"(it holds {sorted(saved)})"
        )
