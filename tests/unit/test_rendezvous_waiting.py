"""The rendezvous' decisions without etcd: a waiting node's next move (:mod:`~elastictrain.rendezvous.waiting`)
and the membership rules (:mod:`~elastictrain.rendezvous.membership`: who waits, when a round is
open, when the closer forms it, whom it takes). ``tests/integration/test_etcd3_rendezvous.py``
runs the same rules against a real etcd."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from elastictrain.rendezvous.membership import Member, absent_members, choose_members, closing, is_open, waiting
from elastictrain.rendezvous.records import (
    FORMED_ALL_IN,
    FORMED_FULL,
    FORMED_LAST_CALL,
    FORMED_PEERS_DEAD,
    MemberRecord,
    RoundRecord,
)
from elastictrain.rendezvous.waiting import Decision, Ending, Look, Me, decide, give_up

LEASE = 7


def _round(number: int, nodes: list[str], *, max_nodes: int = 3, snapshot: int = 100) -> RoundRecord:
    return RoundRecord(round=number, nodes=nodes, nproc=[1] * len(nodes), master_addr="a", master_port=1,
                       snapshot=snapshot, min_nodes=1, max_nodes=max_nodes)


def _me(node: str = "b", *, after: int = 0, registered: int = 50, lease_lost: bool = False, spare: bool = False,
        closing: bool = False) -> Me:
    return Me(node, after, registered, LEASE, lease_lost=lease_lost, spare=spare, closing=closing)


# --- a waiting node's next move ---------------------------------------------------------------


def test_a_round_that_takes_the_node_in_ends_its_wait() -> None:
    assert decide(Look(_round(1, ["a", "b"])), _me(after=0)).ending is Ending.ENTER


def test_the_round_it_waited_after_does_not_count_even_with_the_node_in_it() -> None:
    # A member re-entered (after=1): round 1, which holds it, is the one it wants to leave.
    decision = decide(Look(_round(1, ["a", "b"]), closer="a"), _me(after=1))
    assert decision.ending is None
    assert decision == Decision()  # someone else gathers the next round: only wait


@pytest.mark.parametrize(("look", "me", "ending"), [
    (Look(None, problem=ValueError("corrupt")), _me(), Ending.PROBLEM),
    (Look(None, stopped=True), _me(), Ending.LEFT),
    (Look(_round(1, ["a"]), closed=True), _me(), Ending.CLOSED),
    (Look(_round(1, ["a", "b", "c"]), closed=True), _me("d", spare=True), Ending.CLOSED_AS_SPARE),
    # A closed run wins over a round that would take the node in: the job ended.
    (Look(_round(1, ["a", "b"]), closed=True), _me(after=0), Ending.CLOSED),
    # An unreadable control key wins over everything but a lost lease.
    (Look(_round(1, ["a", "b"]), problem=ValueError("corrupt"), closed=True, stopped=True), _me(), Ending.PROBLEM),
])
def test_a_problem_a_departure_or_a_closed_run_ends_the_wait(look: Look, me: Me, ending: Ending) -> None:
    assert decide(look, me).ending is ending


def test_a_node_that_lost_its_lease_registers_again_before_anything_else() -> None:
    decision = decide(Look(_round(1, ["a", "b"]), closed=True), _me(after=0, lease_lost=True, closing=True))
    assert decision == Decision(register_again=True)


def test_a_round_full_without_the_node_makes_it_a_candidate_spare() -> None:
    full = _round(1, ["a", "b", "c"], max_nodes=3, snapshot=40)
    # Registered after the round was decided (a late joiner): it waits, as a spare if the round stands.
    decision = decide(Look(full, closer=None), _me("d", after=1, registered=50))
    assert decision.spare_if_full is full and decision.join_after is None and decision.try_to_close
    # Once a spare, it is not asked again.
    assert decide(Look(full), _me("d", after=1, registered=50, spare=True)).spare_if_full is None
    # A round with room left is no reason to be a spare.
    assert decide(Look(_round(1, ["a", "b"], max_nodes=3)), _me("d", after=1)).spare_if_full is None


def test_a_node_left_out_of_a_round_decided_with_its_key_in_view_asks_for_the_next_one() -> None:
    full = _round(2, ["a", "b", "c"], max_nodes=3, snapshot=60)
    decision = decide(Look(full), _me("d", after=1, registered=50))
    assert decision == Decision(spare_if_full=full, join_after=2)
    # Registered after the snapshot: the round could not have taken it; it just waits.
    assert decide(Look(full), _me("d", after=1, registered=70)).join_after is None


def test_a_free_closer_key_is_taken_and_a_lost_one_released() -> None:
    assert decide(Look(_round(1, ["a"]), closer=None), _me(after=1)).try_to_close
    # Its closer formed a round or lost the key to another node: drop it; someone holds the key.
    decision = decide(Look(_round(1, ["a"]), closer="a"), _me(after=1, closing=True))
    assert decision == Decision(release_closer=True)
    # The key went and nobody holds it: drop the old closer, try again.
    assert decide(Look(_round(1, ["a"]), closer=None), _me(after=1, closing=True)) == Decision(
        release_closer=True, try_to_close=True)


def test_a_closer_key_held_on_this_lease_without_a_closer_is_gathered_again() -> None:
    look = Look(_round(1, ["a"]), closer="b", closer_key_lease=LEASE, closer_key_created=33)
    assert decide(look, _me(after=1)) == Decision(resume_closer=33)
    # It still runs its closer: nothing to do but wait.
    assert decide(look, _me(after=1, closing=True)) == Decision()
    # The key is on an older lease of this node's (etcd will expire it): not this node's to resume.
    stale = Look(_round(1, ["a"]), closer="b", closer_key_lease=LEASE - 1, closer_key_created=33)
    assert decide(stale, _me(after=1)) == Decision()
    # The key names another node (the view's lease field is the key's, whatever it says): not this node's.
    assert decide(Look(_round(1, ["a"]), closer="a", closer_key_lease=LEASE, closer_key_created=33),
                  _me(after=1)) == Decision()


def test_the_first_round_a_node_waits_for() -> None:
    assert decide(Look(None), _me(after=-1)) == Decision(try_to_close=True)
    assert decide(Look(None, closer="a"), _me(after=-1)) == Decision()
    assert decide(Look(_round(0, ["a", "b"])), _me(after=-1)).ending is Ending.ENTER


# --- the join timeout -----------------------------------------------------------------------


def test_a_node_waiting_for_a_round_gives_up_at_the_join_timeout() -> None:
    def never() -> bool:
        pytest.fail("a node that is no spare never asks whether the round stands")
    assert not give_up(9.9, 10.0, join_timeout=10, spare=False, has_round=True, open_at_last_look=False,
                       stands=never).timed_out
    assert give_up(10.0, 10.0, join_timeout=10, spare=False, has_round=True, open_at_last_look=False,
                   stands=never).timed_out


def test_a_spare_waits_while_the_job_trains_and_gives_up_once_a_round_stays_open() -> None:
    calls: list[str] = []

    def standing(answer: bool) -> Callable[[], bool]:
        def stands() -> bool:
            calls.append("asked")
            return answer
        return stands

    # The round stands (its members train): the spare waits one more join timeout.
    timing = give_up(10.0, 10.0, join_timeout=10, spare=True, has_round=True, open_at_last_look=False,
                     stands=standing(True))
    assert (timing.deadline, timing.open_at_last_look, timing.timed_out) == (20.0, False, False)
    # The round is open (a member gone): one more join timeout to re-form ...
    timing = give_up(20.0, 20.0, join_timeout=10, spare=True, has_round=True, open_at_last_look=False,
                     stands=standing(False))
    assert (timing.deadline, timing.open_at_last_look, timing.timed_out) == (30.0, True, False)
    # ... and still open a join timeout later: it gives up.
    timing = give_up(30.0, 30.0, join_timeout=10, spare=True, has_round=True, open_at_last_look=True,
                     stands=standing(False))
    assert timing.timed_out
    # Before its deadline it asks etcd nothing.
    give_up(25.0, 30.0, join_timeout=10, spare=True, has_round=True, open_at_last_look=True, stands=standing(False))
    assert calls == ["asked"] * 3


def test_a_spare_with_no_round_yet_times_out_like_any_node() -> None:
    assert give_up(10.0, 10.0, join_timeout=10, spare=True, has_round=False, open_at_last_look=False,
                   stands=lambda: True).timed_out


# --- the membership rules -------------------------------------------------------------------


def _member(node: str, *, after: int, created: int, modified: int | None = None) -> Member:
    record = MemberRecord(node=node, addr="a", host="h", pid=1, nproc=1, port=1, after=after)
    return Member(record, created, created if modified is None else modified)


def _members(*members: Member) -> dict[str, Member]:
    return {m.record.node: m for m in members}


def test_who_waits_for_the_next_round() -> None:
    current = _round(2, ["a", "b"], snapshot=100)
    members = _members(_member("a", after=2, created=10, modified=120),  # re-entered: waits
                       _member("b", after=1, created=11),                  # trains on: does not
                       _member("c", after=1, created=110),                 # came later: waits
                       _member("d", after=1, created=90))                  # left out for want of room
    assert sorted(m.record.node for m in waiting(members, current)) == ["a", "c"]
    assert len(waiting(members, None)) == 4  # no round yet: every live node


def test_a_round_is_open_once_a_member_is_gone_or_asks_again() -> None:
    current = _round(2, ["a", "b"])
    assert not is_open(_members(_member("a", after=1, created=1), _member("b", after=1, created=2)), current)
    assert is_open(_members(_member("a", after=1, created=1)), current)               # b is gone
    assert is_open(_members(_member("a", after=2, created=1), _member("b", after=1, created=2)), current)
    assert is_open({}, None)


def test_the_next_round_takes_current_members_first_then_registration_order() -> None:
    current = _round(2, ["b", "c"])
    candidates = [_member("a", after=2, created=1), _member("b", after=2, created=5), _member("c", after=2, created=6),
                  _member("d", after=2, created=3)]
    assert [m.record.node for m in choose_members(candidates, current, 3)] == ["a", "b", "c"]
    assert [m.record.node for m in choose_members(candidates, None, 3)] == ["a", "d", "b"]


def test_absent_members_are_live_members_of_the_round_that_have_not_asked() -> None:
    current = _round(2, ["a", "b", "c"])
    members = _members(_member("a", after=2, created=1), _member("b", after=1, created=2))  # c is gone
    assert absent_members(members, current, [members["a"]]) == ["b"]
    assert absent_members(members, None, []) == []


def test_the_closer_waits_for_min_nodes_then_the_last_call() -> None:
    members = _members(_member("a", after=-1, created=1))
    assert closing(members, None, now=0.0, quorum_since=None, min_nodes=2, max_nodes=3, last_call=1.0).chosen is None
    members = _members(_member("a", after=-1, created=1), _member("b", after=-1, created=2))
    first = closing(members, None, now=5.0, quorum_since=None, min_nodes=2, max_nodes=3, last_call=1.0)
    assert (first.chosen, first.wake, first.quorum_since) == (None, 6.0, 5.0)
    later = closing(members, None, now=6.0, quorum_since=5.0, min_nodes=2, max_nodes=3, last_call=1.0)
    assert [m.record.node for m in later.chosen or []] == ["a", "b"]


def test_the_closer_forms_at_once_at_max_nodes_or_when_every_survivor_is_in() -> None:
    three = _members(*(_member(n, after=-1, created=i) for i, n in enumerate("abc")))
    assert closing(three, None, now=0.0, quorum_since=None, min_nodes=2, max_nodes=3, last_call=9.0).chosen
    # A re-formation: b died, a and c re-entered; every live node is in: no last call.
    current = _round(1, ["a", "b", "c"])
    members = _members(_member("a", after=1, created=1), _member("c", after=1, created=3))
    assert closing(members, current, now=0.0, quorum_since=None, min_nodes=2, max_nodes=3, last_call=9.0).chosen
    # A live member that has not asked yet keeps a full set waiting for the last call (a spare must
    # not take the seat of a healthy member a moment from re-entering).
    members = _members(_member("a", after=1, created=1), _member("b", after=0, created=2),
                       _member("c", after=1, created=3), _member("d", after=0, created=4))
    verdict = closing(members, current, now=0.0, quorum_since=None, min_nodes=2, max_nodes=3, last_call=9.0)
    assert verdict.chosen is None and verdict.wake == 9.0


def test_a_standing_round_is_not_closed_whoever_waits() -> None:
    current = _round(1, ["a", "b"])
    members = _members(_member("a", after=0, created=1), _member("b", after=0, created=2),
                       _member("c", after=0, created=3))
    assert closing(members, current, now=99.0, quorum_since=1.0, min_nodes=1, max_nodes=3, last_call=1.0) == \
        closing(members, current, now=0.0, quorum_since=None, min_nodes=1, max_nodes=3, last_call=1.0)
    assert closing(members, current, now=99.0, quorum_since=1.0, min_nodes=1, max_nodes=3,
                   last_call=1.0).chosen is None


def test_a_member_found_dead_is_not_waited_for_and_the_round_says_so() -> None:
    # b was killed: its lease lives on, and its probe port was refused.
    current = _round(1, ["a", "b", "c"])
    members = _members(_member("a", after=1, created=1), _member("b", after=0, created=2),
                       _member("c", after=1, created=3))
    waits = closing(members, current, now=0.0, quorum_since=None, min_nodes=2, max_nodes=3, last_call=9.0)
    assert (waits.chosen, waits.wake, waits.unasked) == (None, 9.0, ["b"])  # the closer probes b
    verdict = closing(members, current, now=0.0, quorum_since=None, min_nodes=2, max_nodes=3, last_call=9.0,
                      dead=frozenset({"b"}))
    assert [m.record.node for m in verdict.chosen or []] == ["a", "c"]
    assert (verdict.reason, verdict.found_dead) == (FORMED_PEERS_DEAD, ["b"])
    # Without it, the last call forms the same round, and says so.
    late = closing(members, current, now=9.0, quorum_since=0.0, min_nodes=2, max_nodes=3, last_call=9.0)
    assert [m.record.node for m in late.chosen or []] == ["a", "c"] and (late.reason, late.found_dead) == \
        (FORMED_LAST_CALL, [])


def test_a_dead_member_does_not_form_a_round_another_live_one_is_missing_from() -> None:
    current = _round(1, ["a", "b", "c"], max_nodes=4)
    members = _members(_member("a", after=1, created=1), _member("b", after=0, created=2),
                       _member("c", after=0, created=3))
    verdict = closing(members, current, now=0.0, quorum_since=None, min_nodes=1, max_nodes=4, last_call=9.0,
                      dead=frozenset({"b"}))
    assert (verdict.chosen, verdict.unasked) == (None, ["c"])  # c still probed: b needs no more
    # The last call then forms it, and names b as found dead all the same.
    late = closing(members, current, now=9.0, quorum_since=0.0, min_nodes=1, max_nodes=4, last_call=9.0,
                   dead=frozenset({"b"}))
    assert (late.reason, late.found_dead) == (FORMED_LAST_CALL, ["b"])


def test_a_node_that_asked_is_a_candidate_whatever_its_probe_said_and_a_first_round_probes_nobody() -> None:
    current = _round(1, ["a", "b"])
    members = _members(_member("a", after=1, created=1), _member("b", after=1, created=2))
    verdict = closing(members, current, now=0.0, quorum_since=None, min_nodes=2, max_nodes=3, last_call=9.0,
                      dead=frozenset({"b"}))
    assert [m.record.node for m in verdict.chosen or []] == ["a", "b"]
    assert (verdict.reason, verdict.found_dead) == (FORMED_ALL_IN, [])
    first = _members(_member("a", after=-1, created=1), _member("b", after=-1, created=2))
    verdict = closing(first, None, now=0.0, quorum_since=None, min_nodes=2, max_nodes=3, last_call=9.0,
                      dead=frozenset({"b"}))
    assert (verdict.chosen, verdict.unasked) == (None, [])
    full = _members(*(_member(n, after=-1, created=i) for i, n in enumerate("abc")))
    assert closing(full, None, now=0.0, quorum_since=None, min_nodes=2, max_nodes=3, last_call=9.0).reason == \
        FORMED_FULL


def test_a_full_set_waits_for_an_absent_member_unless_it_is_found_dead() -> None:
    # b has not asked, d is a spare: a live b keeps its seat until the last call; a dead b does not.
    current = _round(1, ["a", "b", "c"])
    members = _members(_member("a", after=1, created=1), _member("b", after=0, created=2),
                       _member("c", after=1, created=3), _member("d", after=0, created=104))
    assert closing(members, current, now=0.0, quorum_since=None, min_nodes=2, max_nodes=3, last_call=9.0).chosen \
        is None
    verdict = closing(members, current, now=0.0, quorum_since=None, min_nodes=2, max_nodes=3, last_call=9.0,
                      dead=frozenset({"b"}))
    assert [m.record.node for m in verdict.chosen or []] == ["a", "c", "d"]
    assert (verdict.reason, verdict.found_dead) == (FORMED_PEERS_DEAD, ["b"])
