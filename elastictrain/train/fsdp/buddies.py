"""Who keeps a copy of whose shards, and whether what survives covers the state: pure decisions.

:func:`buddies` picks, for each rank, the rank that holds a copy of its shards (its *holder*),
from the node each rank is on; :func:`missing` says which regions of the state the holdings of
the surviving ranks do not cover at a step (empty: the state can be rebuilt from memory; else the
caller restores from the newest checkpoint). :mod:`~elastictrain.train.fsdp.redundancy` does the I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from elastictrain.train.fsdp.holdings import Holding, Region

__all__ = ["buddies", "missing"]


def buddies(nodes: Sequence[int]) -> list[int | None]:
    """The holder of each rank's copy: ``holders[r]`` keeps rank ``r``'s shards.

    Ranks are ordered by node (then rank) and each one's copy goes ``m`` places further round
    that ring, ``m`` the most ranks any node has: with nodes of equal size, the rank of the same
    local rank on the next node. Every rank holds exactly one copy and none its own; a copy is
    on another node whenever no node has more than half the ranks (else, unavoidably, some
    copies of the largest node stay on it). One node: the next rank. One rank: None.

    Args:
        nodes: The node of each rank (any hashable ids; equal ids are one node).

    Raises:
        ValueError: No ranks.
    """
    world = len(nodes)
    if world == 0:
        raise ValueError("buddies of an empty group: nodes is empty")
    if world == 1:
        return [None]
    ring = sorted(range(world), key=lambda r: (nodes[r], r))
    counts: dict[int, int] = {}
    for node in nodes:
        counts[node] = counts.get(node, 0) + 1
    shift = max(counts.values()) if len(counts) > 1 else 1
    holders: list[int | None] = [None] * world
    for i, rank in enumerate(ring):
        holders[rank] = ring[(i + shift) % world]
    return holders


def _subtract(box: Region, cut: Holding) -> list[Region]:
    """``box`` less the part ``cut`` covers, as disjoint boxes (at most two per dimension)."""
    lows = [max(o, c) for o, c in zip(box.offsets, cut.offsets, strict=True)]
    highs = [min(o + s, c + z) for o, s, c, z in zip(box.offsets, box.sizes, cut.offsets, cut.sizes, strict=True)]
    if any(lo >= hi for lo, hi in zip(lows, highs, strict=True)):
        return [box]  # disjoint (a 0-d tensor's box is never disjoint: it has no dimension)
    left: list[Region] = []
    offsets, sizes = list(box.offsets), list(box.sizes)
    for dim, (lo, hi) in enumerate(zip(lows, highs, strict=True)):
        start, end = offsets[dim], offsets[dim] + sizes[dim]
        for a, b in ((start, lo), (hi, end)):  # the slabs of this dimension outside the cut
            if a < b:
                left.append(Region(box.key, (*offsets[:dim], a, *offsets[dim + 1:]),
                                   (*sizes[:dim], b - a, *sizes[dim + 1:])))
        offsets[dim], sizes[dim] = lo, hi - lo  # go on within the cut along this dimension
    return left


def missing(holdings_by_rank: Mapping[int, Iterable[Holding]], needed: Iterable[Region], step: int) -> list[Region]:
    """The parts of ``needed`` that no holding of ``step`` covers, over every rank given.

    Args:
        holdings_by_rank: What each surviving rank holds (its own shards and the copies it keeps).
        needed: The whole state: one region per tensor, its full box (see
            :func:`~elastictrain.train.fsdp.holdings.state_regions`).
        step: The step to rebuild; holdings of other steps do not count.

    Returns:
        The uncovered boxes, disjoint; empty when the survivors cover the state at ``step``.
    """
    by_key: dict[str, list[Holding]] = {}
    for holdings in holdings_by_rank.values():
        for holding in holdings:
            if holding.step == step:
                by_key.setdefault(holding.key, []).append(holding)
    left: list[Region] = []
    for region in needed:
        boxes = [region]
        for holding in by_key.get(region.key, ()):
            if len(holding.offsets) != len(region.offsets):
                raise ValueError(f"{region.key}: a holding of {len(holding.offsets)} dimensions for a tensor of "
                                 f"{len(region.offsets)}")
            boxes = [part for box in boxes for part in _subtract(box, holding)]
            if not boxes:
                break
        left.extend(box for box in boxes if all(boxes_size > 0 for boxes_size in box.sizes))
    return left
