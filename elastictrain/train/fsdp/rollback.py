"""Which step a re-formed sharded group rebuilds from: a pure decision.

When an fsdp group re-forms, every live rank announces what it holds of the training state,
each piece with the committed step it is of: the regions of the sharded state (its live shards at
its committed step; under ``redundancy_every``, its snapshots of its own shards and the copy of
its buddy's, at the steps of the refreshes) and the steps whose replicated state it holds (the
sampler cursor, scheduler, scaler, RNG, step counter and extras: the live ones at its committed
step, and those it kept with each snapshot). :func:`choose_rebuild` picks the newest step whose
every region the new layout needs is held by some live rank, and whose replicated state some live
rank holds; every rank then rolls back to it from memory, and the steps after it are redone. None:
no step is held whole, and the group restores its newest checkpoint instead.

No torch, no I/O: every rank decides the same from the same announcements.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elastictrain.train.fsdp.regions import Plan, Region, plan_exchange

__all__ = ["Rebuild", "choose_rebuild"]


@dataclass(frozen=True, slots=True)
class Rebuild:
    """The step the group rebuilds from, and how."""

    step: int
    """The newest step the live ranks hold whole."""
    plan: Plan
    """Who sends which region of that step to whom (covered)."""
    holders: tuple[int, ...]
    """The ranks that hold that step's replicated state (lowest first): they send it to the others."""


def choose_rebuild(held: Mapping[int, Sequence[Region]], replicated: Mapping[int, Sequence[int]],
                   needs: Sequence[Region]) -> Rebuild | None:
    """The newest step the live ranks can rebuild the whole state at (see the module docstring).

    Args:
        held: By step, the regions of the sharded state the live ranks hold at that step (each
            region names its rank).
        replicated: By step, the ranks that hold the replicated state of that step.
        needs: The regions every rank needs in the new layout
            (:func:`~elastictrain.train.fsdp.regions.needed_regions`).

    Returns:
        The newest such step, with the moves that rebuild it; None when no step is held whole.
    """
    for step in sorted(set(held) | set(replicated), reverse=True):
        holders = tuple(sorted(set(replicated.get(step, ()))))
        if not holders:
            continue
        plan = plan_exchange(held.get(step, ()), needs)
        if plan.covered:
            return Rebuild(step, plan, holders)
    return None
