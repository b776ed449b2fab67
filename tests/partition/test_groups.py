"""group_parameters: tied weights, frozen parameters, mixed dtypes, optimizer param groups."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zeroshard.partition import GroupKey, group_parameters


class _Tiny(nn.Module):
    """Embedding tied to the output head, a frozen norm, a half-precision adapter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 4)
        self.norm = nn.LayerNorm(4)
        self.body = nn.Linear(4, 4)
        self.adapter = nn.Linear(4, 4).half()
        self.head = nn.Linear(4, 11, bias=False)
        self.head.weight = self.emb.weight
        self.norm.requires_grad_(False)


def _names(groups: dict[GroupKey, list[tuple[str, nn.Parameter]]]) -> dict[GroupKey, list[str]]:
    return {k: [n for n, _ in v] for k, v in groups.items()}


F32, F16 = torch.float32, torch.float16


def test_tied_frozen_and_mixed_dtypes_in_first_seen_order() -> None:
    model = _Tiny()
    named = list(model.named_parameters(remove_duplicate=False))
    assert "head.weight" in [n for n, _ in named]  # the tie is visible to the grouping
    got = _names(group_parameters(named))
    assert list(got.items()) == [
        (GroupKey(F32, True, 0, "default"), ["emb.weight", "body.weight", "body.bias"]),
        (GroupKey(F32, False, 0, "default"), ["norm.weight", "norm.bias"]),
        (GroupKey(F16, True, 0, "default"), ["adapter.weight", "adapter.bias"]),
    ]
    # The kept entries are the very Parameter objects, the tied one under its first name.
    groups = group_parameters(named)
    first = groups[GroupKey(F32, True, 0, "default")][0][1]
    assert first is model.emb.weight and first is model.head.weight


def test_tied_under_a_later_name_first_wins() -> None:
    model = _Tiny()
    named = [("head.weight", model.head.weight), *model.named_parameters()]
    got = _names(group_parameters(named))
    assert got[GroupKey(F32, True, 0, "default")] == ["head.weight", "body.weight", "body.bias"]


def test_optimizer_param_groups_split_buffers() -> None:
    model = _Tiny()
    # What an optimizer's param_groups look like (partition knows no optimizers).
    param_groups = [
        {"params": [model.body.weight, model.emb.weight]},
        {"params": [model.body.bias, *model.adapter.parameters()], "lr": 0.1},
    ]
    of = {id(p): i for i, g in enumerate(param_groups) for p in g["params"]}
    got = _names(group_parameters(model.named_parameters(), param_group_of=of))
    assert list(got.items()) == [
        (GroupKey(F32, True, 0, "default"), ["emb.weight", "body.weight"]),
        # Frozen and outside the optimizer: group index 0, its own key by requires_grad.
        (GroupKey(F32, False, 0, "default"), ["norm.weight", "norm.bias"]),
        (GroupKey(F32, True, 1, "default"), ["body.bias"]),
        (GroupKey(F16, True, 1, "default"), ["adapter.weight", "adapter.bias"]),
    ]


def test_trainable_param_outside_the_optimizer_is_named() -> None:
    model = _Tiny()
    of = {id(p): 0 for p in model.parameters() if p is not model.body.bias}
    with pytest.raises(ValueError, match=r"'body\.bias' requires grad"):
        group_parameters(model.named_parameters(), param_group_of=of)


def test_process_groups_split_buffers() -> None:
    model = _Tiny()

    def pg(name: str, p: nn.Parameter) -> str:
        return "expert" if name.startswith("body.") else "default"

    got = _names(group_parameters(model.named_parameters(), process_group_of=pg))
    assert got[GroupKey(F32, True, 0, "expert")] == ["body.weight", "body.bias"]
    assert got[GroupKey(F32, True, 0, "default")] == ["emb.weight"]
    assert len(got) == 4


def test_one_name_for_two_parameters_is_an_error() -> None:
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="'w'"):
        group_parameters([("w", a), ("w", b)])
