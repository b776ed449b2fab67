"""Hypothesis strategies for the partition tests."""

from __future__ import annotations

from hypothesis import strategies as st

from tests.partition._helpers import DTYPES
from zeroshard.partition import FlatLayout

# Shapes include scalars () and zero-size dimensions.
shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


@st.composite
def layouts(draw: st.DrawFn, max_params: int = 8) -> FlatLayout:
    """A FlatLayout over random shapes, dtype, world size 1-8 and alignment 1-16."""
    shape_list = draw(st.lists(shapes, min_size=1, max_size=max_params))
    return FlatLayout.build(
        [(f"p{i}", s) for i, s in enumerate(shape_list)],
        draw(st.sampled_from(DTYPES)),
        world_size=draw(st.integers(1, 8)),
        alignment=draw(st.integers(1, 16)),
    )
