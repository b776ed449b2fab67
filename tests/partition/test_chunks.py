"""ChunkLayout: even shards, exact coverage, JSON, and shards that gather into chunks."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests._dist import run_each, run_ranks, subtests
from tests.partition._helpers import bitwise_equal, random_bits
from zeroshard.comm import Group
from zeroshard.partition import CHUNK_FORMAT_VERSION, ChunkLayout

SETTINGS = settings(max_examples=80, deadline=None)
sizes = st.tuples(st.integers(0, 5000), st.integers(1, 700), st.integers(1, 8))


@SETTINGS
@given(sizes)
def test_every_rank_moves_the_same_bytes_and_chunks_cover_the_buffer(
    size: tuple[int, int, int],
) -> None:
    numel, chunk, world = size
    lay = ChunkLayout.build(numel, chunk, world)
    assert lay.chunk_numel % world == 0 and chunk <= lay.chunk_numel < chunk + world
    assert lay.padded_numel >= numel and lay.padded_numel - numel < lay.chunk_numel
    assert lay.num_chunks == (0 if numel == 0 else -(-numel // lay.chunk_numel))
    owner = torch.full((lay.padded_numel,), -1, dtype=torch.long)
    for i in range(lay.num_chunks):
        lo, hi = lay.chunk_range(i)
        assert hi - lo == lay.chunk_numel
        shards = [lay.shard_range(i, r) for r in range(world)]
        # Evenness: every rank's part of every chunk is the same size.
        assert {b - a for a, b in shards} == {lay.shard_numel}
        assert shards[0][0] == lo and shards[-1][1] == hi
        for r, (a, b) in enumerate(shards):
            assert (owner[a:b] == -1).all(), "shards overlap"
            owner[a:b] = i * world + r
    # Coverage: every element of the padded buffer belongs to exactly one (chunk, rank).
    assert (owner >= 0).all()
    assert ChunkLayout.from_json(lay.to_json()) == lay


@SETTINGS
@given(sizes, st.one_of(st.none(), st.integers(), st.text(max_size=3)))
def test_from_json_rejects_other_versions(size: tuple[int, int, int], version: object) -> None:
    d = json.loads(ChunkLayout.build(*size).to_json())
    d["format"] = CHUNK_FORMAT_VERSION + 1 if version == CHUNK_FORMAT_VERSION else version
    with pytest.raises(ValueError, match="format version"):
        ChunkLayout.from_json(json.dumps(d))


def test_bad_chunk_input() -> None:
    with pytest.raises(ValueError, match="chunk_numel"):
        ChunkLayout.build(10, 0, 2)
    with pytest.raises(ValueError, match="world_size"):
        ChunkLayout.build(10, 4, 0)
    with pytest.raises(ValueError, match="numel"):
        ChunkLayout.build(-1, 4, 2)
    with pytest.raises(ValueError, match="multiple of world_size"):
        ChunkLayout(10, 5, 2)
    lay = ChunkLayout.build(10, 4, 2)
    with pytest.raises(ValueError, match="chunk 3 out of range"):
        lay.chunk_range(3)
    with pytest.raises(ValueError, match="rank 2 out of range"):
        lay.shard_range(0, 2)
    for bad in (
        "[1]",
        '{"format": 1, "numel": 3}',
        '{"format": 1, "numel": 3, "chunk_numel": 3, "world_size": 2}',
    ):
        with pytest.raises(ValueError):
            ChunkLayout.from_json(bad)


def _gather_case(numel: int, chunk: int, dtype: torch.dtype) -> None:
    group = Group()
    device = group.device
    lay = ChunkLayout.build(numel, chunk, group.size)
    # Same seed on every rank: every rank knows the whole buffer to check against.
    flat = random_bits((numel,), dtype, torch.Generator().manual_seed(numel + chunk))
    padded = torch.zeros(lay.padded_numel, dtype=dtype)
    padded[:numel] = flat
    device_flat = padded.to(device)
    for i in range(lay.num_chunks):
        lo, hi = lay.shard_range(i, group.rank)
        out = torch.empty(lay.chunk_numel, dtype=dtype, device=device)
        group.all_gather_into(out, device_flat[lo:hi], label=f"chunk {i}").wait()
        lo, hi = lay.chunk_range(i)
        assert bitwise_equal(out, padded[lo:hi]), f"chunk {i}"


def _gather_body() -> None:
    cases = subtests({"numel": [1, 50, 97], "chunk": [1, 16, 100], "dtype": [torch.float16]})
    run_each(cases, _gather_case)


@pytest.mark.gpu
def test_chunk_shards_gather_into_the_buffer(device: str) -> None:
    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    # Two ranks suffice here: evenness over 1-8 ranks is the property test's job.
    run_ranks(_gather_body, 2, device=device)
