"""Who sends which region of the sharded state to whom when a group re-forms: a pure planner.

The regions are boxes of global tensors, cut along dimension 0 as FSDP2 cuts them (``torch.chunk``:
uneven, trailing ranks may hold none). Every rank needs the box of each tensor that its place in
the new layout gives it (:func:`needed_regions`); the ranks hold the boxes they announced (their
own shards of the previous generation, copies a redundancy source keeps). :func:`plan_exchange`
picks, for each needed row range, one holder: the rank itself when it holds it, else the holder
that has sent the fewest elements so far (the lowest rank on a tie), and reports the regions that
no rank holds. No torch, no I/O: every rank computes the same plan from the same announcements.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from elastictrain._chunks import chunk_span

__all__ = ["Move", "Plan", "Region", "TensorSpec", "chunk_box", "needed_regions", "plan_exchange"]


def chunk_box(shape: tuple[int, ...], index: int, count: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The box (offsets, sizes) of chunk ``index`` of ``count`` of a tensor of ``shape``, cut along
    dimension 0 as ``torch.chunk`` cuts it (each chunk ``ceil(rows / count)`` rows, the last ones
    shorter or empty); a 0-d tensor's whole (empty) box.

    Raises:
        ValueError: ``index`` is not in ``range(count)``.
    """
    start, size = chunk_span(shape[0] if shape else 0, index, count)
    if not shape:
        return (), ()
    return (start, *(0,) * (len(shape) - 1)), (size, *shape[1:])


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor of the state, as the new layout places it."""

    key: str
    """Its key (``"model/<fqn>"``, ``"optimizer/<fqn>/<state name>"``)."""
    shape: tuple[int, ...]
    """Its global shape."""
    sharded: bool
    """Cut along dimension 0 over a shard group (parameters and their state); else every rank
    holds it whole (buffers, scalar state)."""


@dataclass(frozen=True, order=True, slots=True)
class Region:
    """A box of a tensor of the state that a rank holds (announced) or needs."""

    rank: int
    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def rows(self) -> tuple[int, int]:
        """Its row range along dimension 0 (``(0, 1)`` for a 0-d tensor)."""
        if not self.sizes:
            return 0, 1
        return self.offsets[0], self.offsets[0] + self.sizes[0]

    def spans(self, other: Region) -> bool:
        """Whether it spans ``other``'s box in every dimension but the first."""
        return len(self.sizes) == len(other.sizes) and all(
            a <= b and a + n >= b + m
            for a, n, b, m in zip(self.offsets[1:], self.sizes[1:], other.offsets[1:], other.sizes[1:], strict=True))


@dataclass(frozen=True, slots=True)
class Move:
    """Rows ``rows`` of ``key`` (all of the needed box's other dimensions) go from ``src`` to
    ``dst`` (``src == dst``: a copy within the rank)."""

    src: int
    dst: int
    key: str
    rows: tuple[int, int]


@dataclass(frozen=True, slots=True)
class Plan:
    """What :func:`plan_exchange` decided."""

    moves: tuple[Move, ...]
    """Every move, in the order every rank posts them."""
    uncovered: tuple[Region, ...]
    """The needed regions (row ranges) that no rank holds: the state cannot be rebuilt from memory."""

    @property
    def covered(self) -> bool:
        return not self.uncovered


def needed_regions(specs: Iterable[TensorSpec], world_size: int, shard_width: int) -> list[Region]:
    """The box of each tensor every rank of the new layout needs.

    Args:
        specs: The tensors of the state.
        world_size: Ranks in the new group.
        shard_width: Ranks per shard group: ``world_size`` under fsdp, the ranks per node under
            hsdp (rank ``r`` holds chunk ``r % shard_width``).

    Raises:
        ValueError: ``shard_width`` does not divide ``world_size``.
    """
    if shard_width < 1 or world_size % shard_width:
        raise ValueError(f"shard width {shard_width} does not divide the world size {world_size}")
    needs = []
    for spec in specs:
        for rank in range(world_size):
            if spec.sharded:
                offsets, sizes = chunk_box(spec.shape, rank % shard_width, shard_width)
            else:
                offsets, sizes = (0,) * len(spec.shape), spec.shape
            needs.append(Region(rank, spec.key, offsets, sizes))
    return needs


def plan_exchange(held: Sequence[Region], needs: Sequence[Region]) -> Plan:
    """Who sends which rows of each needed region (see the module docstring).

    Args:
        held: The regions each rank holds at the agreed step.
        needs: The regions each rank needs (:func:`needed_regions`).
    """
    # Each key's holders with their row ranges, worked out once (a re-formation plans thousands
    # of regions: ~400 tensors of an LM's parameters and AdamW state, times the ranks).
    by_key: dict[str, list[tuple[int, int, tuple[tuple[int, ...], tuple[int, ...]], Region]]] = {}
    for region in sorted(held, key=_order):
        by_key.setdefault(region.key, []).append((*region.rows, _tail(region), region))
    sent: dict[int, int] = {}
    moves: list[Move] = []
    uncovered: list[Region] = []
    for need in sorted(needs, key=_order):
        start, stop = need.rows
        if start == stop:
            continue  # an empty chunk (more ranks than rows)
        per_row = math.prod(need.sizes[1:])
        tail = _tail(need)
        holders = [(low, high, h.rank) for low, high, other, h in by_key.get(need.key, ())
                   if low < stop and high > start and (other == tail or h.spans(need))]
        if any(rank == need.rank and low <= start and high >= stop for low, high, rank in holders):
            moves.append(Move(need.rank, need.rank, need.key, (start, stop)))  # it holds it all: a copy within
            continue
        cuts = sorted({start, stop, *(max(start, min(stop, edge)) for low, high, _ in holders for edge in (low, high))})
        pieces: list[tuple[int | None, int, int]] = []
        for low, high in zip(cuts, cuts[1:], strict=False):
            able = sorted({rank for first, last, rank in holders if first <= low and last >= high})
            if not able:
                src = None
            elif need.rank in able:
                src = need.rank
            else:
                src = min(able, key=lambda r: (sent.get(r, 0), r))
                sent[src] = sent.get(src, 0) + (high - low) * per_row
            if pieces and pieces[-1][0] == src and pieces[-1][2] == low:
                pieces[-1] = (src, pieces[-1][1], high)
            else:
                pieces.append((src, low, high))
        for src, low, high in pieces:
            if src is None:
                offsets = (low, *need.offsets[1:]) if need.sizes else ()
                sizes = (high - low, *need.sizes[1:]) if need.sizes else ()
                uncovered.append(Region(need.rank, need.key, offsets, sizes))
            else:
                moves.append(Move(src, need.rank, need.key, (low, high)))
    return Plan(tuple(moves), tuple(uncovered))


def _tail(region: Region) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Its box in every dimension but the first (equal tails: each spans the other)."""
    return region.offsets[1:], region.sizes[1:]


def _order(region: Region) -> tuple[int, str, tuple[int, ...], tuple[int, ...]]:
    """:class:`Region`'s own order, as a key (a tuple compares in C; the dataclass's ``<`` in Python)."""
    return region.rank, region.key, region.offsets, region.sizes
