"""The one chunk arithmetic (:mod:`elastictrain._chunks`) against ``torch.chunk``, and both of its
users (the checkpoint's ``region`` and the exchange planner's ``chunk_box``) against it."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from elastictrain._chunks import chunk_span
from elastictrain.checkpoint import region
from elastictrain.train.fsdp.regions import chunk_box

pytestmark = pytest.mark.timeout(30)

# Even, uneven (a short last chunk), more chunks than rows (empty trailing chunks: torch.chunk
# returns fewer than asked), ceil-rounding that empties a chunk early (5 rows in 4: 2, 2, 1, 0),
# and an empty dimension.
CASES = [(8, 4), (7, 2), (7, 3), (10, 4), (5, 4), (3, 4), (1, 3), (0, 2), (6, 1), (13, 5)]


def _expected(length: int, count: int) -> list[tuple[int, int]]:
    """(start, size) of each chunk as torch.chunk cuts an arange; missing chunks are empty at the end."""
    pieces = list(torch.chunk(torch.arange(length), count)) if length else []
    spans, start = [], 0
    for piece in pieces:
        assert piece.numel() == 0 or int(piece[0]) == start
        spans.append((start, piece.numel()))
        start += piece.numel()
    return spans + [(length, 0)] * (count - len(pieces))


@pytest.mark.parametrize(("length", "count"), CASES)
def test_chunk_span_matches_torch_chunk_including_uneven_and_empty_chunks(length: int, count: int) -> None:
    assert [chunk_span(length, i, count) for i in range(count)] == _expected(length, count)


@pytest.mark.parametrize(("length", "count"), CASES)
def test_region_and_chunk_box_cut_as_chunk_span(length: int, count: int) -> None:
    for i in range(count):
        start, size = chunk_span(length, i, count)
        assert chunk_box((length, 3), i, count) == ((start, 0), (size, 3))
        assert region((length, 3), (count,), (i,), (Shard(0),), "w") == ((start, 0), (size, 3))
        # Shard(1) cuts the second dimension the same way; a replica holds the whole tensor.
        assert region((3, length), (2, count), (1, i), (Replicate(), Shard(1)), "w") == ((0, start), (3, size))


def test_region_cuts_mesh_dimension_by_mesh_dimension_as_dtensor_does() -> None:
    # Shard(0) twice on a 2x2 mesh: 7 rows -> 4, 3 -> (2, 2), (2, 1).
    boxes = [region((7, 2), (2, 2), (a, b), (Shard(0), Shard(0)), "w") for a in range(2) for b in range(2)]
    assert boxes == [((0, 0), (2, 2)), ((2, 0), (2, 2)), ((4, 0), (2, 2)), ((6, 0), (1, 2))]


@pytest.mark.parametrize(("length", "index", "count", "message"), [
    (4, 3, 3, "chunk index 3 is not in range"), (4, -1, 3, "chunk index -1"),
    (4, 0, 0, "chunk count 0 is not positive"), (-1, 0, 2, "chunk length -1 is negative"),
])
def test_chunk_span_refuses_a_bad_argument_naming_it(length: int, index: int, count: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        chunk_span(length, index, count)
