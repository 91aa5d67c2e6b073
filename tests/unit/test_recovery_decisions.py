"""The decisions of in-process recovery, one rule at a time, without processes: the boundary vote
(due, closed, a save in flight, its grace), why the group stops, and where a formed group's state
comes from. The executors that act on them (GroupKeeper, run_elastic) are tested with real
processes in test_inprocess_parts.py and tests/integration/test_inprocess_recovery.py."""

from __future__ import annotations

from datetime import timedelta

import pytest

from elastictrain._control import Assignment
from elastictrain.train.recovery_decisions import (
    SAVE_GRACE,
    Due,
    StateSource,
    boundary_cause,
    state_source,
    vote_at_boundary,
)

pytestmark = pytest.mark.timeout(10)

DUE = Due(due=True, cause="a node joins")
GRACE = timedelta(seconds=10)


def test_a_rank_whose_agent_wants_nothing_votes_to_train_on_and_forgets_a_held_back_vote() -> None:
    vote = vote_at_boundary(Due(due=False), saving=True, due_since=3.0, now=100.0, grace=GRACE)
    assert (vote.wanted, vote.due_since) == (False, None)


def test_a_rank_whose_agent_wants_a_new_generation_votes_to_re_form_when_no_save_is_in_flight() -> None:
    vote = vote_at_boundary(DUE, saving=False, due_since=None, now=100.0, grace=GRACE)
    assert (vote.wanted, vote.due_since) == (True, None)


def test_a_save_in_flight_holds_the_vote_back_from_the_first_boundary_it_does() -> None:
    vote = vote_at_boundary(DUE, saving=True, due_since=None, now=100.0, grace=GRACE)
    assert (vote.wanted, vote.due_since) == (False, 100.0)
    later = vote_at_boundary(DUE, saving=True, due_since=vote.due_since, now=109.0, grace=GRACE)
    assert (later.wanted, later.due_since) == (False, 100.0), "the grace counts from the first boundary held back"


def test_a_save_in_flight_holds_the_vote_back_no_longer_than_the_grace() -> None:
    vote = vote_at_boundary(DUE, saving=True, due_since=100.0, now=110.5, grace=GRACE)
    assert (vote.wanted, vote.due_since) == (True, 100.0)


def test_a_closed_group_does_not_wait_for_a_save_in_flight() -> None:
    vote = vote_at_boundary(Due(due=True, closed=True), saving=True, due_since=None, now=100.0, grace=GRACE)
    assert vote.wanted


def test_the_grace_is_ten_seconds_by_default() -> None:
    assert timedelta(seconds=10) == SAVE_GRACE
    assert not vote_at_boundary(DUE, saving=True, due_since=100.0, now=109.9).wanted
    assert vote_at_boundary(DUE, saving=True, due_since=100.0, now=110.1).wanted


def test_the_agents_word_is_due_when_it_hands_an_assignment_and_carries_its_cause_and_closing() -> None:
    assert Due.of(None) == Due(due=False)
    assignment = Assignment(generation=2, round=1, world_size=2, master_addr="127.0.0.1", master_port=1,
                            ranks={"0": 0}, closed=True, cause="test over")
    assert Due.of(assignment) == Due(due=True, closed=True, cause="test over")


def test_the_group_stops_for_the_agents_word_or_for_its_peers_votes() -> None:
    assert boundary_cause(DUE, 7) == "a node joins (at the boundary after step 7)"
    # A rank whose own agent said nothing (yet) learnt it from its peers' votes.
    assert boundary_cause(Due(due=False), 7) == "the agent re-forms the group (at the boundary after step 7)"
    assert boundary_cause(Due(due=True), 7) == "the agent re-forms the group (at the boundary after step 7)"


@pytest.mark.parametrize(("holds", "someone_holds", "live_transfer", "source"), [
    (False, None, True, StateSource.CHECKPOINT),   # no agreement, nothing held: the job starts
    (True, None, True, StateSource.OWN),           # no agreement, this rank trained: it keeps its own
    (False, False, True, StateSource.CHECKPOINT),  # agreed: no rank holds state (the whole job restarts)
    (False, True, True, StateSource.PEERS),        # a newcomer: it receives from a live replica
    (True, True, True, StateSource.PEERS),         # a survivor: it holds, or receives the newer step
    (True, True, False, StateSource.CHECKPOINT),   # sharded state cannot be handed over: everyone restores
    (False, True, False, StateSource.CHECKPOINT),
    (False, False, False, StateSource.CHECKPOINT),
])
def test_a_formed_groups_state_comes_from_live_peers_only_when_one_holds_it_and_it_can_be_handed_over(
        holds: bool, someone_holds: bool | None, live_transfer: bool, source: StateSource) -> None:
    assert state_source(holds=holds, someone_holds=someone_holds, live_transfer=live_transfer) is source
