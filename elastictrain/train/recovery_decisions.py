"""The decisions of in-process recovery, apart from their doing: whether this rank votes to re-form
the group at a step boundary, why the group stops there, and where a re-formed group's state comes
from. Pure functions of a snapshot (no torch, no I/O, no clock): the executors
(:class:`~elastictrain.train.group_keeper.GroupKeeper` for a ``Session``,
:func:`~elastictrain.train.elastic.run_elastic` for a loop of one's own, both through
:func:`~elastictrain.train.recovery.reform_in_place`) read the world and act on the answer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import timedelta

from elastictrain._control import Assignment

__all__ = ["SAVE_GRACE", "BoundaryVote", "Due", "StateSource", "boundary_cause", "state_source", "vote_at_boundary"]

SAVE_GRACE = timedelta(seconds=10)
"""How long the ranks train on, when their agents want the group re-formed, while a checkpoint
save is in flight (re-forming would wait for it to be written)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Due:
    """The agent's word at a step boundary, as the vote needs it."""

    due: bool
    """The agent wants the group re-formed (a newer generation, or one announced)."""
    closed: bool = False
    """The agent closed the group (the job is over for this rank)."""
    cause: str = ""
    """Why, as the agent said it (may be empty)."""

    @classmethod
    def of(cls, assignment: Assignment | None) -> Due:
        """The agent's word: ``assignment`` when the group must re-form (``WorkerControl.due()``), else None."""
        if assignment is None:
            return cls(due=False)
        return cls(due=True, closed=assignment.closed, cause=assignment.cause or "")


@dataclass(frozen=True, kw_only=True, slots=True)
class BoundaryVote:
    """This rank's vote for the step about to run, and what it remembers until the next one."""

    wanted: bool
    """Stop after this step and re-form the group."""
    due_since: float | None
    """When this rank first held its vote back for a save in flight (monotonic seconds); None
    when it holds none back."""


def vote_at_boundary(due: Due, *, saving: bool, due_since: float | None, now: float,
                     grace: timedelta = SAVE_GRACE) -> BoundaryVote:
    """This rank's vote at a step boundary.

    It votes to re-form when its agent wants a new generation, unless a checkpoint save is in
    flight (``saving``): re-forming would first wait for the save to be written, and the peers
    (a joining node's workers waiting for the group) would wait with it; the rank trains on
    instead, for up to ``grace`` from the boundary it first held its vote back (``due_since``),
    and once the save is written the re-formation costs only itself. A closed group does not wait.

    Args:
        due: The agent's word now.
        saving: A checkpoint save is in flight on this rank.
        due_since: What the previous vote remembered.
        now: Monotonic seconds now.
        grace: How long a save in flight holds the vote back.
    """
    if not due.due:
        return BoundaryVote(wanted=False, due_since=None)
    if due.closed or not saving:
        return BoundaryVote(wanted=True, due_since=due_since)
    since = now if due_since is None else due_since
    return BoundaryVote(wanted=now - since > grace.total_seconds(), due_since=since)


def boundary_cause(due: Due, step: int) -> str:
    """Why the group stops after ``step``, once the vote said so (the agent's word, if it said any:
    a rank whose own agent said nothing yet learnt it from its peers' votes)."""
    said = due.cause if due.due and due.cause else "the agent re-forms the group"
    return f"{said} (at the boundary after step {step})"


class StateSource(enum.Enum):
    """Where a group's training state comes from when it forms."""

    OWN = "own"
    """This rank keeps what it holds (no agreement is taken: a group without in-process recovery)."""
    PEERS = "peers"
    """A live rank holds the newest step: the ranks that lack it receive it from the holders."""
    CHECKPOINT = "checkpoint"
    """Every rank reads the newest committed checkpoint (if there is one)."""


def state_source(*, holds: bool, someone_holds: bool | None, live_transfer: bool) -> StateSource:
    """Where the state of a group that forms comes from.

    Args:
        holds: This rank holds training state (it trained in a previous generation).
        someone_holds: Whether any rank of the group holds state, as the ranks agreed; None when
            no agreement is taken (no in-process recovery, or no group).
        live_transfer: The state can be handed from one live rank to another (every holder holds
            the whole of it: replicated, as DDP's). A sharded strategy's cannot; its ranks then
            read the checkpoint, even those that hold state.
    """
    if someone_holds is None:
        return StateSource.OWN if holds else StateSource.CHECKPOINT
    if someone_holds and live_transfer:
        return StateSource.PEERS
    return StateSource.CHECKPOINT
