"""`FlatLayout.split_sizes`: one split of a gathered buffer gives back every parameter."""

from __future__ import annotations

import torch
from hypothesis import given, settings

from tests.partition._strategies import layouts
from zeroshard.partition import FlatLayout


@settings(deadline=None, max_examples=50)
@given(layouts(max_params=12))
def test_split_sizes_cover_the_buffer_and_find_every_slot(layout: FlatLayout) -> None:
    sizes, piece_of_slot = layout.split_sizes()
    assert sum(sizes) == layout.padded_numel
    assert all(n >= 0 for n in sizes) and len(piece_of_slot) == len(layout.slots)
    buffer = torch.arange(layout.padded_numel)
    pieces = buffer.split(list(sizes))
    for slot, i in zip(layout.slots, piece_of_slot, strict=True):
        torch.testing.assert_close(pieces[i], buffer[slot.offset : slot.end], rtol=0, atol=0)


def test_split_sizes_name_gaps_and_padding() -> None:
    # Alignment 4 on 2 ranks: a (3) | gap 1 | b (2) | padding 2 -> padded to 8.
    layout = FlatLayout.build([("a", (3,)), ("b", (2,))], torch.float32, 2, alignment=4)
    assert layout.split_sizes() == ((3, 1, 2, 2), (0, 2))
