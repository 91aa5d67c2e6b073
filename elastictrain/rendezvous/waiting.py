"""What a node waiting for its next round does next: a pure decision, apart from the doing.

:meth:`~elastictrain.rendezvous.handler.Etcd3RendezvousHandler.next_rendezvous` waits in a loop
that looks at the run's control keys (:class:`~elastictrain.rendezvous.membership.ControlView`),
decides, acts (etcd writes, the closer role) and waits for the next change. As torch's dynamic
rendezvous splits ``_RendezvousJoinOp`` (state in, one action out) from the executor that applies
it, the deciding lives here, free of etcd, threads and clocks, and the handler only executes:

- :func:`decide`: one look at the round (:class:`Look`) and what this node is in its wait
  (:class:`Me`) in, the :class:`Decision` out: end the wait (enter a round, or stop with the
  reason), or what to do before waiting again;
- :func:`give_up`: the join-timeout rule, given the time, the deadline, and whether the round
  stands (asked of etcd only when the rule needs it).

The unit tests (``tests/unit/test_rendezvous_waiting.py``) walk every path without etcd: the
spare, the closer, the late joiner, the lost lease, the closed round.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from elastictrain.rendezvous.records import RoundRecord

__all__ = ["Decision", "Ending", "Look", "Me", "Timing", "decide", "give_up"]


class Ending(enum.Enum):
    """Why the wait ends."""

    ENTER = "enter"
    """A round newer than the one this node waited after takes it in: it joins it."""
    PROBLEM = "problem"
    """The control view found the run's keys unreadable: raise its error."""
    LEFT = "left"
    """This node left the rendezvous (``leave()`` or ``shutdown()`` from another thread)."""
    CLOSED = "closed"
    """The run is closed: the job ended (or was stopped)."""
    CLOSED_AS_SPARE = "closed_as_spare"
    """The run is closed while this node waited as a spare: it exits gracefully."""


@dataclass(frozen=True, slots=True)
class Look:
    """One consistent look at the run's control keys (taken under the view's lock)."""

    round: RoundRecord | None
    """The newest round formed (``None`` before the first)."""
    closer: str | None = None
    """The node that holds the closer key (``None``: nobody)."""
    closer_key_lease: int | None = None
    """The lease of the closer key, as this node last saw it."""
    closer_key_created: int = 0
    """The ``create_revision`` of the closer key."""
    closed: bool = False
    problem: BaseException | None = None
    stopped: bool = False


@dataclass(frozen=True, slots=True)
class Me:
    """This node, as its wait stands."""

    node: str
    after: int
    """It waits for a round newer than this one."""
    registered: int
    """The revision of its last write of its member key."""
    lease: int | None
    """Its liveness lease (``None`` before it was granted)."""
    lease_lost: bool = False
    """etcd expired its liveness lease while it waited (a stall, a cut link)."""
    spare: bool = False
    """It waits as a spare (the round is full without it)."""
    closing: bool = False
    """It runs a closer (it gathers the next round)."""


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do after one look: end the wait, or the actions before waiting again, in this
    order (the executor performs each that is set)."""

    ending: Ending | None = None
    """End the wait (then nothing below applies)."""
    register_again: bool = False
    """Its lease was lost: drop its closer, take a new lease, write its member key again, and
    look again (then nothing below applies)."""
    spare_if_full: RoundRecord | None = None
    """This round is full without this node: it becomes a spare if the round stands (its members
    train; one etcd read). A full round whose members are gone only waits to be re-formed."""
    join_after: int | None = None
    """A round decided with this node's key in view left it out (for want of room): join again,
    asking for the round after this one, and look again at once. Otherwise no later round would
    count it among those waiting (see :func:`~elastictrain.rendezvous.membership.waiting`)."""
    release_closer: bool = False
    """Drop this node's closer: it formed a round, or lost the key."""
    resume_closer: int | None = None
    """The closer key is this node's, on its current lease, but it runs no closer (it dropped it on
    a view an older event had made wrong): no other node can take the key while it lives, so it
    gathers the round again (the value: the key's ``create_revision``)."""
    try_to_close: bool = False
    """Nobody holds the closer key: try to take it."""


def decide(look: Look, me: Me) -> Decision:
    """The next move of a node waiting for a round (see the module docstring)."""
    if me.lease_lost:
        return Decision(register_again=True)
    if look.problem is not None:
        return Decision(Ending.PROBLEM)
    if look.stopped:
        return Decision(Ending.LEFT)
    if look.closed:
        return Decision(Ending.CLOSED_AS_SPARE if me.spare else Ending.CLOSED)
    current = look.round
    in_current = current is not None and current.rank_of(me.node) is not None
    if current is not None and current.round > me.after and in_current:
        return Decision(Ending.ENTER)
    spare_if_full = (current if current is not None and not in_current and not me.spare
                     and len(current.nodes) >= current.max_nodes else None)
    if current is not None and current.round > me.after and not in_current and current.snapshot >= me.registered:
        return Decision(spare_if_full=spare_if_full, join_after=current.round)
    mine = look.closer == me.node
    release = me.closing and not mine
    closing = me.closing and not release
    held = mine and look.closer_key_lease is not None and look.closer_key_lease == me.lease
    resume = look.closer_key_created if held and not closing else None
    return Decision(spare_if_full=spare_if_full, release_closer=release, resume_closer=resume,
                    try_to_close=look.closer is None)


@dataclass(frozen=True, slots=True)
class Timing:
    """The join-timeout rule's verdict: the deadline from now on, and whether to give up."""

    deadline: float
    open_at_last_look: bool
    """A spare's last look found the round open (a member gone and not re-formed)."""
    timed_out: bool


def give_up(now: float, deadline: float, *, join_timeout: float, spare: bool, has_round: bool,
            open_at_last_look: bool, stands: Callable[[], bool]) -> Timing:
    """Whether a waiting node gives up at ``now``.

    A node that waits for a round to form gives up at the join timeout. A spare waits for a seat,
    not for a round to form: it waits as long as the job trains (``stands()``, one etcd read per
    join timeout), since timing out would end the run. It gives up only once a round that lost a
    member has not re-formed for a whole join timeout (it found it open at two looks in a row).
    """
    if now >= deadline and spare and has_round:
        standing = stands()
        if standing or not open_at_last_look:
            return Timing(now + join_timeout, not standing, False)
    return Timing(deadline, open_at_last_look, now >= deadline)
