"""FlatLayout properties: exact tiling by shards, exact coverage by pieces, JSON round trip."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.partition._strategies import layouts
from zeroshard.partition import FORMAT_VERSION, FlatLayout, Piece

SETTINGS = settings(max_examples=80, deadline=None)


def _owner_map(layout: FlatLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Per element of the padded buffer: owning slot index (-1: padding), index within it."""
    owner = torch.full((layout.padded_numel,), -1, dtype=torch.long)
    within = torch.full((layout.padded_numel,), -1, dtype=torch.long)
    for i, s in enumerate(layout.slots):
        assert (owner[s.offset : s.end] == -1).all(), "slots overlap"
        owner[s.offset : s.end] = i
        within[s.offset : s.end] = torch.arange(s.numel)
    return owner, within


@SETTINGS
@given(layouts(max_params=12))
def test_shards_tile_the_padded_buffer(layout: FlatLayout) -> None:
    n = layout.shard_numel
    assert n % layout.alignment == 0
    assert layout.padded_numel % (layout.world_size * layout.alignment) == 0
    # Minimal padding: less than one unit of world * alignment beyond the slots.
    unit = layout.world_size * layout.alignment
    assert layout.padded_numel - layout.numel < unit or layout.padded_numel == unit
    ranges = [layout.shard_range(r) for r in range(layout.world_size)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layout.padded_numel
    for i in range(1, len(ranges)):
        assert ranges[i - 1][1] == ranges[i][0]
    assert all(hi - lo == n for lo, hi in ranges)
    for s in layout.slots:
        assert s.offset % layout.alignment == 0


@SETTINGS
@given(layouts(max_params=12))
def test_pieces_cover_every_slot_exactly(layout: FlatLayout) -> None:
    owner, within = _owner_map(layout)
    n = layout.shard_numel
    covered = torch.zeros(layout.padded_numel, dtype=torch.long)
    for i, s in enumerate(layout.slots):
        pieces = layout.pieces(s)
        assert pieces == layout.pieces(s.name)
        assert sum(p.numel for p in pieces) == s.numel
        assert [p.rank for p in pieces] == sorted({p.rank for p in pieces})
        start = 0
        for p in pieces:
            assert p.slot_start == start and p.numel > 0
            assert p.shard_start >= 0 and p.shard_start + p.numel <= n
            g = p.rank * n + p.shard_start
            assert (owner[g : g + p.numel] == i).all()
            assert torch.equal(within[g : g + p.numel], torch.arange(start, start + p.numel))
            covered[g : g + p.numel] += 1
            start += p.numel
    # Every slot element is covered exactly once, padding never.
    assert torch.equal(covered, (owner >= 0).long())


@SETTINGS
@given(layouts(max_params=12))
def test_slots_in_shard_agree_with_pieces(layout: FlatLayout) -> None:
    by_rank: dict[int, list[tuple[str, Piece]]] = {r: [] for r in range(layout.world_size)}
    for s in layout.slots:
        for p in layout.pieces(s):
            by_rank[p.rank].append((s.name, p))
    for r in range(layout.world_size):
        got = [(s.name, p) for s, p in layout.slots_in_shard(r)]
        assert got == by_rank[r]


@SETTINGS
@given(layouts(max_params=12), st.integers(1, 8))
def test_json_round_trip(layout: FlatLayout, other_world: int) -> None:
    assert FlatLayout.from_json(layout.to_json()) == layout
    resharded = layout.resharded(other_world)
    assert [s.offset for s in resharded.slots] == [s.offset for s in layout.slots]
    assert FlatLayout.from_json(resharded.to_json()) == resharded
    assert resharded.resharded(layout.world_size) == layout


@SETTINGS
@given(layouts(), st.one_of(st.none(), st.integers(), st.text(max_size=3)))
def test_from_json_rejects_other_format_versions(layout: FlatLayout, version: object) -> None:
    d = json.loads(layout.to_json())
    if version == FORMAT_VERSION:
        version = FORMAT_VERSION + 1
    d["format"] = version
    with pytest.raises(ValueError, match="format version"):
        FlatLayout.from_json(json.dumps(d))


def test_malformed_json_is_a_value_error() -> None:
    good = json.loads(FlatLayout.build([("a", (2, 3))], torch.float32, 2).to_json())
    for bad in (
        "[]",
        json.dumps({k: v for k, v in good.items() if k != "slots"}),
        json.dumps({**good, "dtype": "float128"}),
        json.dumps({**good, "slots": [["a", [2, 3], 0, 5]]}),
        json.dumps({**good, "slots": [["a", [2, 3], 0, 6], ["a", [1], 6, 1]]}),
        json.dumps({**good, "padded_numel": 7}),
    ):
        with pytest.raises(ValueError):
            FlatLayout.from_json(bad)


def test_build_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="empty group"):
        FlatLayout.build([], torch.float32, 2)
    with pytest.raises(ValueError, match="'w' appears twice"):
        FlatLayout.build([("w", (2,)), ("w", (3,))], torch.float32, 2)
    with pytest.raises(ValueError, match="negative dimension"):
        FlatLayout.build([("w", (2, -1))], torch.float32, 2)
    with pytest.raises(ValueError, match="world_size"):
        FlatLayout.build([("w", (2,))], torch.float32, 0)
    with pytest.raises(ValueError, match="alignment"):
        FlatLayout.build([("w", (2,))], torch.float32, 1, alignment=0)
    layout = FlatLayout.build([("w", (2,))], torch.float32, 2)
    with pytest.raises(ValueError, match="rank 2 out of range"):
        layout.shard_range(2)
