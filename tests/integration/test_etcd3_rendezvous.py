"""The native etcd3 rendezvous: several node handlers in one process against a real etcd."""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousParameters,
    RendezvousTimeoutError,
    rendezvous_handler_registry,
)

from elastictrain._fault import Fault
from elastictrain.errors import EtcdError
from elastictrain.etcd import kv
from elastictrain.events import NODE_ENV
from elastictrain.launch import launcher
from elastictrain.launch.agent import ElasticAgent
from elastictrain.launch.config import RunConfig
from elastictrain.launch.run_state import NodeRecord, RunPublisher, read_status
from elastictrain.rendezvous import ready as ready_module
from elastictrain.rendezvous import register
from elastictrain.rendezvous.handler import Etcd3RendezvousHandler, create_handler
from elastictrain.rendezvous.keys import RunKeys
from elastictrain.rendezvous.membership import STORES_KEPT, ControlView, read_members
from elastictrain.rendezvous.records import AllReadyRecord, CloserRecord, RoundRecord, decode, encode
from tests.support.tcp_proxy import TcpProxy

# A liveness lease of 2 s (0.5 s x 4, the shortest allowed) keeps the tests short.
SHORT_LEASE = {"keep_alive_interval": 0.5, "keep_alive_max_attempt": 4}
# Handlers that must all be in the first round although fewer would do (min_nodes < n): the
# first round waits the last call for more nodes, and on a loaded machine one handler may
# register more than the default 0.5 s after the others.
ALL_IN_FIRST = {"last_call_timeout": 2}


def _params(endpoint: str, run_id: str, min_nodes: int, max_nodes: int, **conf: Any) -> RendezvousParameters:
    conf = {"last_call_timeout": 0.5, "request_timeout": 2, "retry_deadline": 20, **conf}
    return RendezvousParameters("etcd3", endpoint, run_id, min_nodes, max_nodes, local_addr="127.0.0.1", **conf)


def _handlers(endpoint: str, run_id: str, n: int, min_nodes: int, max_nodes: int,
              **conf: Any) -> list[Etcd3RendezvousHandler]:
    return [create_handler(_params(endpoint, run_id, min_nodes, max_nodes, **conf)) for _ in range(n)]


def _join_all(handlers: list[Any]) -> list[Any]:
    with ThreadPoolExecutor(len(handlers)) as pool:
        return list(pool.map(lambda h: h.next_rendezvous(), handlers))


def _eventually(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout:g}s: {what}")
        time.sleep(0.05)


def _shutdown(*handlers: Etcd3RendezvousHandler) -> None:
    for handler in handlers:
        handler.shutdown()


def test_the_registry_builds_the_native_etcd3_handler(etcd_server: Any, run_id: str) -> None:
    register()
    handler = rendezvous_handler_registry.create_handler(_params(etcd_server.endpoint, run_id, 1, 1))
    assert isinstance(handler, Etcd3RendezvousHandler)
    assert handler.get_backend() == "etcd3" and handler.get_run_id() == run_id
    assert handler.use_agent_store is False
    handler.shutdown()


def test_ranks_follow_registration_order_and_rank_0_carries_the_store_address(etcd_server: Any, run_id: str,
                                                                               etcd_client: Any) -> None:
    handlers = _handlers(etcd_server.endpoint, run_id, 4, 4, 4)
    infos = _join_all(handlers)
    keys = RunKeys.of(run_id)
    _, members = kv.range_(etcd_client, keys.members, prefix=True, what="test")
    by_registration = [m.key[len(keys.members):] for m in sorted(members, key=lambda m: m.create_revision)]
    ranks = {h.node_id: info.rank for h, info in zip(handlers, infos)}
    assert [ranks[node] for node in by_registration] == [0, 1, 2, 3]
    assert {info.world_size for info in infos} == {4}
    stores = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}
    assert len(stores) == 1 and next(iter(stores))[1] > 0
    # Each member's key holds the port it offered; rank 0's is the store's.
    _, [round_kv] = kv.range_(etcd_client, keys.round, what="test")
    record = decode(RoundRecord, round_kv.key, round_kv.value)
    assert record.master_port == next(iter(stores))[1] and record.nodes == by_registration
    _shutdown(*handlers)


def test_each_round_and_each_incarnation_of_a_run_id_has_its_own_store(etcd_server: Any, run_id: str,
                                                                        etcd_client: Any) -> None:
    handlers = _handlers(etcd_server.endpoint, run_id, 2, 2, 2)
    first = _join_all(handlers)
    first[0].store.set("MASTER_ADDR", "stale-host")
    second = _join_all(handlers)  # both ask again: round 1
    assert [h.round for h in handlers] == [1, 1]
    assert not second[0].store.check(["MASTER_ADDR"])
    _shutdown(*handlers)
    # The run's keys vanish (purged, or expired) and the run id starts again at round 0:
    # round 0 of the new incarnation must not read the old round 0's keys.
    old_prefix = first[0].store.prefix
    kv.txn(etcd_client, [], [kv.delete(RunKeys.of(run_id).ctl, prefix=True),
                             kv.delete(RunKeys.of(run_id).members, prefix=True)], what="test")
    again = _handlers(etcd_server.endpoint, run_id, 2, 2, 2)
    infos = _join_all(again)
    assert [h.round for h in again] == [0, 0]
    assert infos[0].store.prefix != old_prefix
    assert not infos[1].store.check(["MASTER_ADDR"])
    _shutdown(*again)


def _metric_total(endpoint: str, pattern: str) -> float:
    """The sum of etcd's metrics whose line ``pattern`` matches (its last group: the value)."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5) as response:
        text = response.read().decode()
    regex = re.compile(pattern)
    return sum(float(m.group(m.lastindex)) for line in text.splitlines() if (m := regex.match(line)))


def _kv_requests(endpoint: str) -> float:
    return _metric_total(endpoint, r'^grpc_server_msg_received_total\{[^}]*grpc_method="(Range|Txn|Put|DeleteRange)"'
                                   r'[^}]*\} (\S+)$')


def test_a_waiting_node_polls_nothing_it_is_woken_by_a_watch(private_etcd: Any, run_id: str) -> None:
    first, second = _handlers(private_etcd.endpoint, run_id, 2, 2, 2)
    waiting = ThreadPoolExecutor(1).submit(first.next_rendezvous)
    _eventually(lambda: first._closer is not None, 10, "the first node takes the closer role")
    before = _kv_requests(private_etcd.endpoint)
    time.sleep(3)  # three of the old poll periods
    assert _kv_requests(private_etcd.endpoint) == before, "the waiting node sent key-value requests"
    second.next_rendezvous()
    assert waiting.result(timeout=10).world_size == 2
    _shutdown(first, second)


def test_the_ready_nodes_are_learnt_from_the_watch_not_counted_at_every_tick(private_etcd: Any, run_id: str) -> None:
    # Every node of a job asks at each monitor tick while a joining node starts (up to 60 s):
    # a count each would be 10,000 requests a second at 1,000 nodes. The node whose word
    # completes the count says so in one key that the others' control watch brings them.
    nodes = _handlers(private_etcd.endpoint, run_id, 3, 3, 3)
    _join_all(nodes)
    for handler in nodes[:2]:
        handler.say_ready()
    before = _kv_requests(private_etcd.endpoint)
    asked = [[h.ready_nodes() for h in nodes] for _ in range(20)]  # 20 monitor ticks, at once
    assert _kv_requests(private_etcd.endpoint) == before, "asking how many nodes are ready sent requests"
    assert all(count < 3 for row in asked for count in row), asked
    nodes[2].say_ready()  # the last one: its count is complete
    _eventually(lambda: [h.ready_nodes() for h in nodes] == [3, 3, 3], 5, "every node learns that all are ready")
    before = _kv_requests(private_etcd.endpoint)
    assert [h.ready_nodes() for h in nodes] == [3, 3, 3]
    assert _kv_requests(private_etcd.endpoint) == before
    _shutdown(*nodes)


def test_when_no_node_said_all_are_ready_each_counts_the_ready_keys_now_and_then(
        private_etcd: Any, run_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The node that completed the count may have failed to write the all-ready key (etcd
    # went away, the node died just after): the others count the keys themselves, seldom,
    # and the first to find them all says so for everyone.
    monkeypatch.setattr(ready_module, "RECOUNT", timedelta(seconds=0.5))
    nodes = _handlers(private_etcd.endpoint, run_id, 2, 2, 2)
    _join_all(nodes)
    keys, round_ = nodes[0].keys, nodes[0].round
    for handler in nodes:  # as say_ready() writes them, without the all-ready key
        kv.txn(handler.client, [], [kv.put(keys.ready(round_) + handler.node_id, b"{}")], what="test")
    assert nodes[0].ready_nodes() == 0  # nothing counted yet
    _eventually(lambda: nodes[0].ready_nodes() == 2, 5, "the node counts the ready keys itself")
    _eventually(lambda: nodes[1].ready_nodes() == 2, 5, "the other node learns it from the key it wrote")
    _, found = kv.range_(nodes[0].client, keys.all_ready, what="test")
    assert [decode(AllReadyRecord, keys.all_ready, item.value).round for item in found] == [round_]
    _shutdown(*nodes)


def test_a_late_word_that_all_are_ready_for_an_older_round_leaves_the_newer_rounds_key(
        etcd_server: Any, run_id: str, etcd_client: Any) -> None:
    # A node completes the ready count of its round only after a newer round has formed and
    # said all its nodes are ready (its request was slow, or it was cut off). Before, its
    # write replaced the newer round's key: those nodes then counted the ready keys every
    # 5 s instead of learning it from their watch.
    nodes = _handlers(etcd_server.endpoint, run_id, 2, 2, 2)
    _join_all(nodes)
    keys, old = nodes[0].keys, nodes[0].joined
    assert old is not None
    nodes[1].say_ready()  # 1 of 2: no word for all yet
    newer = dataclasses.replace(old, round=old.round + 1)
    kv.txn(etcd_client, [], [kv.put(keys.round, encode(newer)),
                             kv.put(keys.all_ready, encode(AllReadyRecord(newer.round)))], what="test")
    nodes[0].say_ready()  # completes the older round's count, late
    _, found = kv.range_(etcd_client, keys.all_ready, what="test")
    assert [decode(AllReadyRecord, keys.all_ready, item.value).round for item in found] == [newer.round]
    _shutdown(*nodes)


def test_a_member_that_re_enters_to_take_in_a_joining_node_leaves_the_change_joins_only(etcd_server: Any,
                                                                                       run_id: str) -> None:
    # Chaos, stop 32 (`--schedule kill_node@2,kill_worker@8`, 1 run in 4): the other member
    # took the first one's re-entry for a request after a failure, re-formed at once instead
    # of training on, and when a node died just then its workers waited in the new group for
    # the dead node until its lease expired (5.2 s to recover instead of about 1).
    first, second = _handlers(etcd_server.endpoint, run_id, 2, 2, 3)
    _join_all([first, second])
    [joiner] = _handlers(etcd_server.endpoint, run_id, 1, 2, 3)
    def first_re_entered() -> bool:
        member = read_members(first.client, first.keys).get(first.node_id)
        return member is not None and member.record.after >= first.round

    with ThreadPoolExecutor(3) as pool:
        joining = pool.submit(joiner.next_rendezvous)
        _eventually(lambda: first.num_nodes_waiting() == 1 and first.only_nodes_joining(), 10,
                    "the first member sees the joining node")
        first.reenter_for_joiners()
        re_entered = pool.submit(first.next_rendezvous)
        _eventually(first_re_entered, 10, "the first member re-enters")
        # The second member looks only now: its watch brings both the joining node and the
        # first member's re-entry.
        _eventually(lambda: second.num_nodes_waiting() == 2, 10, "the second member sees both")
        assert second.only_nodes_joining()
        infos = [f.result(timeout=20) for f in (pool.submit(second.next_rendezvous), re_entered, joining)]
    assert [info.world_size for info in infos] == [3, 3, 3]
    _shutdown(first, second, joiner)


def test_a_late_node_finds_the_rendezvous_closed_and_a_spare_exits_gracefully(etcd_server: Any,
                                                                              run_id: str) -> None:
    first, spare = _handlers(etcd_server.endpoint, run_id, 2, 1, 1)
    first.next_rendezvous()
    waiting = ThreadPoolExecutor(1).submit(spare.next_rendezvous)  # the round is full: a spare
    time.sleep(1)
    assert first.num_nodes_waiting() == 0  # a spare does not make the full round re-form
    first.set_closed()
    with pytest.raises(RendezvousGracefulExitError):
        waiting.result(timeout=10)
    late = create_handler(_params(etcd_server.endpoint, run_id, 1, 1))
    assert late.is_closed()
    with pytest.raises(RendezvousClosedError):
        late.next_rendezvous()
    _shutdown(first, spare, late)


@pytest.mark.parametrize("earlier_nodes", [0, 2], ids=["new-run", "relaunch-after-every-node-died"])
def test_a_node_that_registers_within_the_last_call_is_in_the_first_round(etcd_server: Any, run_id: str,
                                                                          earlier_nodes: int) -> None:
    # min_nodes are there at once, the third node a moment later (a slower start): as in
    # torch's dynamic rendezvous, the first round waits the last call for it instead of
    # forming with the first two and leaving it to wait for a round nobody asks for. The same
    # when the job is launched again after all its nodes died: the round they left has no
    # survivor among the new nodes.
    if earlier_nodes:
        earlier = _handlers(etcd_server.endpoint, run_id, earlier_nodes, earlier_nodes, earlier_nodes)
        _join_all(earlier)
        for handler in earlier:
            handler.leave()  # gone without closing the rendezvous (a crash, once its lease expired)
    first_two = _handlers(etcd_server.endpoint, run_id, 2, 2, 3, last_call_timeout=5)
    late = create_handler(_params(etcd_server.endpoint, run_id, 2, 3, last_call_timeout=5))
    spares: list[int] = []
    for handler in [*first_two, late]:
        handler.on_spare = spares.append  # the round they find is full, but nobody of it is left
    pool = ThreadPoolExecutor(3)
    try:
        gathering = [pool.submit(h.next_rendezvous) for h in first_two]
        _eventually(lambda: len(read_members(first_two[0].client, first_two[0].keys)) == 2, 5,
                    "the first two registered")
        joining = pool.submit(late.next_rendezvous)
        infos = [f.result(timeout=15) for f in gathering]
        assert [i.world_size for i in infos] == [3, 3], "the first round formed without the node that came late"
        assert joining.result(timeout=15).world_size == 3
        assert spares == [], "a node said it waits as a spare for a round whose members are all gone"
    finally:
        _shutdown(*first_two, late)
        pool.shutdown()


def test_join_timeout_raises_the_rendezvous_timeout_error(etcd_server: Any, run_id: str) -> None:
    [alone] = _handlers(etcd_server.endpoint, run_id, 1, 2, 2, join_timeout=1.5)
    with pytest.raises(RendezvousTimeoutError, match="did not complete within 1.5s"):
        alone.next_rendezvous()
    _shutdown(alone)


def test_members_see_a_joiner_below_max_and_re_form_with_it(etcd_server: Any, run_id: str) -> None:
    handlers = _handlers(etcd_server.endpoint, run_id, 2, 2, 3)
    _join_all(handlers)
    joiner = create_handler(_params(etcd_server.endpoint, run_id, 2, 3))
    joining = ThreadPoolExecutor(1).submit(joiner.next_rendezvous)
    _eventually(lambda: all(h.num_nodes_waiting() == 1 for h in handlers), 10, "members see the joiner")
    infos = [*_join_all(handlers), joining.result(timeout=10)]
    assert {i.world_size for i in infos} == {3} and sorted(i.rank for i in infos) == [0, 1, 2]
    assert [h.num_nodes_waiting() for h in [*handlers, joiner]] == [0, 0, 0]
    _shutdown(*handlers, joiner)


def test_a_new_round_deletes_the_store_of_the_round_three_before_it(etcd_server: Any, run_id: str,
                                                                    etcd_client: Any) -> None:
    """Each round's store keys stayed as long as the run: a long job's keys grew with each
    re-formation, and status and every starting node read them all."""
    handlers = _handlers(etcd_server.endpoint, run_id, 2, 2, 2)
    for _ in range(6):
        infos = _join_all(handlers)
        infos[0].store.set("ranks", "from this round's agents")
    assert [h.round for h in handlers] == [5, 5]
    stores = RunKeys.of(run_id).prefix + "store/"
    _, found = kv.range_(etcd_client, stores, prefix=True, keys_only=True, what="test")
    rounds = {int(item.key[len(stores):].split("/")[1]) for item in found}
    assert rounds == set(range(6 - STORES_KEPT, 6))
    _shutdown(*handlers)


def test_members_see_a_member_that_asks_for_a_new_round(etcd_server: Any, run_id: str) -> None:
    handlers = _handlers(etcd_server.endpoint, run_id, 3, 2, 3, **ALL_IN_FIRST)
    _join_all(handlers)
    again = ThreadPoolExecutor(1).submit(handlers[0].next_rendezvous)  # its workers failed
    _eventually(lambda: all(h.num_nodes_waiting() >= 1 for h in handlers[1:]), 10, "the others see it")
    rest = _join_all(handlers[1:])
    infos = [again.result(timeout=10), *rest]
    assert {i.world_size for i in infos} == {3} and [h.round for h in handlers] == [1, 1, 1]
    _shutdown(*handlers)


def test_a_lost_member_is_seen_from_its_lease_and_the_survivors_re_form(etcd_server: Any, run_id: str) -> None:
    handlers = _handlers(etcd_server.endpoint, run_id, 3, 2, 3, **SHORT_LEASE, **ALL_IN_FIRST)
    _join_all(handlers)
    dead = handlers[2]
    dead._alive.close()
    started = time.monotonic()
    _eventually(lambda: all(h.num_nodes_waiting() >= 1 for h in handlers[:2]), 10,
                "the survivors see the dead member once etcd expires its lease")
    assert time.monotonic() - started < 2 + 2  # the 2 s lease, with slack for a loaded machine
    infos = _join_all(handlers[:2])
    assert {i.world_size for i in infos} == {2}
    _shutdown(*handlers[:2])
    dead.leave()


def test_a_dead_member_whose_lease_runs_on_is_not_taken_into_later_rounds(etcd_server: Any, run_id: str) -> None:
    # A killed node's key lives until its lease expires. The survivors re-form without it
    # (it never asks again); a second re-formation meanwhile (another fault) must not take
    # it for a node waiting to join: the new group would wait for it until the lease ran out
    # (chaos, stop 28: a worker killed 1.4 s after a node, 3.3-3.8 s to recover, not 0.3).
    handlers = _handlers(etcd_server.endpoint, run_id, 3, 2, 3, keep_alive_interval=5, keep_alive_max_attempt=6,
                         **ALL_IN_FIRST)
    _join_all(handlers)
    dead = handlers[2]
    dead._alive.close()
    survivors = handlers[:2]
    for _ in range(2):
        infos = _join_all(survivors)
        assert {i.world_size for i in infos} == {2}
    # Nor does `status` count it as waiting to join (probe, stop 29: "held waiting" 2 s after a kill).
    assert read_status(survivors[0].client, run_id).waiting == []
    late = _handlers(etcd_server.endpoint, run_id, 1, 2, 3)[0]  # a node that comes later still joins
    infos = _join_all([*survivors, late])
    assert {i.world_size for i in infos} == {3}
    _shutdown(*survivors, late)
    dead.leave()


def test_a_spare_left_out_for_want_of_room_takes_the_place_of_a_member_that_leaves(etcd_server: Any,
                                                                                   run_id: str) -> None:
    # The spare's key was in view when the full round formed without it: it asks again for
    # the next round, or that round would not count it among the nodes that wait.
    handlers = _handlers(etcd_server.endpoint, run_id, 3, 2, 2)
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(h.next_rendezvous) for h in handlers]
        _eventually(lambda: sum(f.done() for f in futures) == 2, 20, "a full round of 2 forms")
        members = [h for h, f in zip(handlers, futures, strict=True) if f.done()]
        [spare] = [h for h in handlers if h not in members]
        members[1].leave()  # gone, seen at once
        survivor = pool.submit(members[0].next_rendezvous)
        assert futures[handlers.index(spare)].result(timeout=20).world_size == 2
        assert survivor.result(timeout=20).world_size == 2
    _shutdown(members[0], spare)


def test_a_spare_says_once_that_it_waits_as_a_spare_and_a_member_never(etcd_server: Any, run_id: str) -> None:
    calls: list[tuple[str, int]] = []
    members = _handlers(etcd_server.endpoint, run_id, 2, 2, 2)
    for handler in members:
        handler.on_spare = lambda nodes: calls.append(("member", nodes))
    _join_all(members)
    [spare] = _handlers(etcd_server.endpoint, run_id, 1, 2, 2)
    spare.on_spare = lambda nodes: calls.append(("spare", nodes))
    with ThreadPoolExecutor(2) as pool:
        waiting = pool.submit(spare.next_rendezvous)
        _eventually(lambda: bool(calls), 10, "the spare reports itself")
        time.sleep(1.5)  # it goes on waiting: once is enough
        assert calls == [("spare", 2)] and not waiting.done()
        members[1].leave()
        survivor = pool.submit(members[0].next_rendezvous)
        assert waiting.result(timeout=20).world_size == survivor.result(timeout=20).world_size == 2
    assert calls == [("spare", 2)]
    _shutdown(members[0], spare)


def test_a_spare_waits_past_the_join_timeout_while_the_job_trains(etcd_server: Any, run_id: str) -> None:
    # Probe, stop 29: a spare timed out after --join-timeout and closed a run that was training.
    members = _handlers(etcd_server.endpoint, run_id, 2, 2, 2, join_timeout=1.5)
    _join_all(members)
    [spare] = _handlers(etcd_server.endpoint, run_id, 1, 2, 2, join_timeout=1.5)
    waiting = ThreadPoolExecutor(1).submit(spare.next_rendezvous)
    time.sleep(4)  # more than twice the join timeout
    assert not waiting.done(), waiting.exception()
    assert not members[0].is_closed() and members[0].num_nodes_waiting() == 0
    members[0].set_finished()
    with pytest.raises(RendezvousGracefulExitError):
        waiting.result(timeout=10)
    _shutdown(*members, spare)


def test_a_member_that_re_enters_after_a_spare_took_its_seat_waits_as_a_spare_past_the_join_timeout(
        etcd_server: Any, run_id: str) -> None:
    # Chaos with spares, this stop: a member that re-entered only after the last call found the
    # round full without it. It waited for the next round as a plain node: it never said it was
    # a spare, and at the join timeout it would have timed out and closed a job that trained.
    calls: list[str] = []
    first, second = _handlers(etcd_server.endpoint, run_id, 2, 2, 2, join_timeout=1.5)
    _join_all([first, second])
    [spare] = _handlers(etcd_server.endpoint, run_id, 1, 2, 2, join_timeout=1.5)
    spare.on_spare = lambda nodes: calls.append("spare")
    second.on_spare = lambda nodes: calls.append("second")
    with ThreadPoolExecutor(3) as pool:
        spare_waits = pool.submit(spare.next_rendezvous)
        _eventually(lambda: calls == ["spare"], 10, "the spare is in")
        again = pool.submit(first.next_rendezvous)  # its worker failed; the second member is slow
        assert spare_waits.result(timeout=10).world_size == again.result(timeout=10).world_size == 2
        late = pool.submit(second.next_rendezvous)  # the round is full without it
        time.sleep(4)  # more than twice the join timeout
        assert not late.done(), late.exception()
        assert calls == ["spare", "second"] and not first.is_closed()
        first.set_finished()
        with pytest.raises(RendezvousGracefulExitError):
            late.result(timeout=10)
    _shutdown(first, second, spare)


def test_a_member_re_entering_keeps_its_healthy_peers_seat_from_a_spare(etcd_server: Any, run_id: str) -> None:
    # Probe, stop 29: a node whose worker failed re-entered the rendezvous, and it and the spare
    # formed the next round at once (max nodes reached): the healthy member, a moment later,
    # was left out as a spare and the job restored its checkpoint, with no live state left.
    first, second = _handlers(etcd_server.endpoint, run_id, 2, 2, 2, last_call_timeout=3)
    _join_all([first, second])
    [spare] = _handlers(etcd_server.endpoint, run_id, 1, 2, 2, last_call_timeout=3)
    with ThreadPoolExecutor(3) as pool:
        spare_waits = pool.submit(spare.next_rendezvous)
        time.sleep(1)  # the spare is in
        again = pool.submit(second.next_rendezvous)  # its worker failed
        _eventually(lambda: first.num_nodes_waiting() >= 1, 10, "the healthy member sees it")
        time.sleep(0.3)  # the healthy member's agent takes a moment to re-enter
        assert not again.done(), "the round formed without the healthy member"
        healthy = pool.submit(first.next_rendezvous)
        infos = [healthy.result(timeout=10), again.result(timeout=10)]
        assert {i.world_size for i in infos} == {2} and first.round == second.round == 1
        assert not spare_waits.done()
        first.set_finished()
        with pytest.raises(RendezvousGracefulExitError):
            spare_waits.result(timeout=10)
    _shutdown(first, second, spare)


def test_a_node_that_dies_while_gathering_does_not_block_the_next_ones(etcd_server: Any, run_id: str,
                                                                       etcd_client: Any) -> None:
    # It registers, takes the closer role, and dies before anyone else arrives.
    [dying] = _handlers(etcd_server.endpoint, run_id, 1, 2, 2, **SHORT_LEASE)
    gathering = threading.Thread(target=lambda: pytest.raises(RendezvousClosedError, dying.next_rendezvous),
                                 daemon=True)
    gathering.start()
    _eventually(lambda: dying._closer is not None, 10, "the first node takes the closer role")
    dying._alive.close()
    dying._control.close()
    gathering.join(10)
    assert not gathering.is_alive() and dying._closer is None
    later = _handlers(etcd_server.endpoint, run_id, 2, 2, 2, **SHORT_LEASE)
    infos = _join_all(later)
    assert {i.world_size for i in infos} == {2}
    record = decode(RoundRecord, RunKeys.of(run_id).round,
                    kv.range_(etcd_client, RunKeys.of(run_id).round, what="test")[1][0].value)
    assert dying.node_id not in record.nodes and sorted(record.nodes) == sorted(h.node_id for h in later)
    _shutdown(*later)


def test_a_node_that_takes_the_closer_role_while_its_watch_lags_keeps_it_and_forms_the_round(
        etcd_server: Any, run_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The closer leaves while gathering; a waiting node takes the freed closer key. On a loaded
    # machine its control watch reports that write a moment later, after the node has looked
    # again (here at the end of the last call). It must not take itself for a node that lost
    # the key and drop its closer while keeping the key: no round could form while it lives.
    deliver = ControlView._on_events

    def late(view: ControlView, events: Any, revision: int) -> None:
        time.sleep(1.5)  # longer than the 0.5 s last call
        deliver(view, events, revision)

    monkeypatch.setattr(ControlView, "_on_events", late)
    first = create_handler(_params(etcd_server.endpoint, run_id, 2, 4, last_call_timeout=30))  # forms nothing
    later = _handlers(etcd_server.endpoint, run_id, 2, 2, 4)
    pool = ThreadPoolExecutor(3)
    try:
        leaving = pool.submit(first.next_rendezvous)
        _eventually(lambda: first._closer is not None, 10, "the first node takes the closer role")
        joining = [pool.submit(h.next_rendezvous) for h in later]
        _eventually(lambda: len(read_members(first.client, first.keys)) == 3, 10, "the others registered")
        first.leave()
        with pytest.raises(RendezvousClosedError):
            leaving.result(timeout=10)
        assert [f.result(timeout=30).world_size for f in joining] == [2, 2]
    finally:
        _shutdown(*later)
        pool.shutdown()


def test_an_etcd_outage_longer_than_the_lease_drops_no_live_node(private_etcd: Any, run_id: str) -> None:
    # etcd judges leases; while it is down nothing expires, and when it returns it
    # renews every lease: live nodes keep their place, and a node that arrives
    # afterwards joins them.
    handlers = _handlers(private_etcd.endpoint, run_id, 2, 2, 3, **SHORT_LEASE)
    _join_all(handlers)
    private_etcd.kill()
    time.sleep(4)  # two lease TTLs
    private_etcd.start()
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:  # keep-alives resume meanwhile
        assert [h.num_nodes_waiting() for h in handlers] == [0, 0]
        time.sleep(0.2)
    late = create_handler(_params(private_etcd.endpoint, run_id, 2, 3, **SHORT_LEASE))
    joining = ThreadPoolExecutor(1).submit(late.next_rendezvous)
    _eventually(lambda: all(h.num_nodes_waiting() == 1 for h in handlers), 10, "the late node is seen")
    infos = [*_join_all(handlers), joining.result(timeout=30)]
    assert {i.world_size for i in infos} == {3}
    _shutdown(*handlers, late)


def test_a_node_whose_lease_expired_learns_it_and_rejoins(etcd_server: Any, run_id: str, etcd_client: Any) -> None:
    # However it happened (a stalled agent, a cut link), etcd expired the node's lease:
    # the others see it gone, and the node itself must learn it too, or it would train
    # on in a round that no longer exists.
    handlers = _handlers(etcd_server.endpoint, run_id, 2, 2, 2, **SHORT_LEASE)
    _join_all(handlers)
    cut = handlers[1]
    lease_id = cut._alive.id
    etcd_client.call(lambda c: c.revoke_lease(lease_id))
    _eventually(lambda: handlers[0].num_nodes_waiting() >= 1, 10, "the other node sees it gone")
    _eventually(lambda: cut.num_nodes_waiting() >= 1, 10, "the node learns that its lease expired")
    infos = _join_all(handlers)
    assert {i.world_size for i in infos} == {2} and [h.round for h in handlers] == [1, 1]
    _shutdown(*handlers)


def test_leaving_without_closing_is_seen_at_once(etcd_server: Any, run_id: str) -> None:
    handlers = _handlers(etcd_server.endpoint, run_id, 2, 1, 2, **ALL_IN_FIRST)
    _join_all(handlers)
    handlers[1].leave()  # SIGTERM path: revokes its lease
    _eventually(lambda: handlers[0].num_nodes_waiting() == 1, 2, "the other node sees it gone")
    assert not handlers[0].is_closed()
    _shutdown(handlers[0])


def test_leaving_ends_a_rendezvous_that_this_node_waits_for_in_another_thread(etcd_server: Any,
                                                                              run_id: str) -> None:
    # Before, the waiting thread went on looking at a view that its closed watch no longer
    # updated, until the join timeout.
    [alone] = _handlers(etcd_server.endpoint, run_id, 1, 2, 2, join_timeout=20)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(alone.next_rendezvous)
        _eventually(lambda: alone.node_id in read_members(alone.client, alone.keys), 10, "it registered")
        alone.leave()
        with pytest.raises(RendezvousClosedError, match="left the rendezvous"):
            waiting.result(timeout=5)


def test_a_node_leaving_while_etcd_is_down_gives_up_revoking_its_lease_well_before_the_retry_deadline(
        private_etcd: Any, run_id: str, caplog: pytest.LogCaptureFixture) -> None:
    # A scheduler SIGKILLs a node that outlives its grace period (30 s in Kubernetes): a node
    # that leaves must not spend the 30 s retry deadline on a revoke etcd cannot answer, since
    # its lease expires on its own.
    handlers = _handlers(private_etcd.endpoint, run_id, 2, 1, 2, retry_deadline=30, **ALL_IN_FIRST)
    _join_all(handlers)
    private_etcd.kill()
    started = time.monotonic()
    with caplog.at_level(logging.DEBUG, logger="elastictrain"):
        handlers[1].leave()
    took = time.monotonic() - started
    assert took < 10, f"leave() took {took:.1f}s with etcd down (the retry deadline is 30 s)"
    said = [r.getMessage() for r in caplog.records
            if r.levelno >= logging.INFO and "liveness lease" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("could not revoke the liveness lease"), said
    handlers[0].leave()


def test_a_node_whose_job_ended_while_etcd_is_down_says_goodbye_within_seconds_not_retry_deadlines(
        private_etcd: Any, run_id: str) -> None:
    # Probe, this stop: with etcd down as the job ended, each node exited 92 s later: closing
    # the rendezvous as finished, closing it again at shutdown and publishing its last record
    # each waited out the 30 s retry deadline.
    # Later, each of them (and the revoke) still waited 5 s: about 17 s in all. The goodbyes
    # now share 5 s, as the launcher makes them: closing as finished, the last record, and
    # the shutdown (a second one, after the node left, sends nothing).
    handlers = _handlers(private_etcd.endpoint, run_id, 2, 1, 2, retry_deadline=30, **ALL_IN_FIRST)
    _join_all(handlers)
    ending = handlers[1]
    publisher = RunPublisher(ending.client, ending.keys, ending.run_lease,
                             NodeRecord(node_id=ending.node_id, host="h", addr="127.0.0.1", pid=1))
    private_etcd.kill()
    started = time.monotonic()
    with pytest.raises(EtcdError, match="etcd unreachable for"):
        ending.set_finished()
    with pytest.raises(EtcdError, match="etcd unreachable for"):
        publisher.update(state="succeeded")
    assert ending.shutdown() is False  # said in one line, as before
    assert ending.shutdown() is False
    took = time.monotonic() - started
    assert took < 8, f"the goodbyes took {took:.1f}s with etcd down (they share 5 s)"
    handlers[0].leave()


def test_a_node_whose_job_failed_while_etcd_is_down_says_goodbye_within_seconds(private_etcd: Any,
                                                                                  run_id: str) -> None:
    # The launcher publishes a node's last record before it closes the rendezvous (ed51d62). A
    # job that failed says no word that it finished, which began the goodbyes' shared 5 s:
    # that record then retried for the whole retry deadline (30 s here) with etcd down.
    handlers = _handlers(private_etcd.endpoint, run_id, 2, 1, 2, retry_deadline=30, **ALL_IN_FIRST)
    _join_all(handlers)
    ending = handlers[1]

    class FailedAgent:
        """What the launcher asks of an agent whose job failed: its run, and its last record."""

        stopped_by_request = False
        _publisher = RunPublisher(ending.client, ending.keys, ending.run_lease,
                                  NodeRecord(node_id=ending.node_id, host="h", addr="127.0.0.1", pid=1))
        _publish = ElasticAgent._publish

        def run(self) -> None:
            raise RendezvousTimeoutError("the next round did not form")

    private_etcd.kill()
    started = time.monotonic()
    outcome = launcher._run_agent(FailedAgent(), ending, RunConfig(script=__file__, run_id=run_id))  # type: ignore[arg-type]
    took = time.monotonic() - started
    assert outcome.exit_code == 1 and "timed out" in outcome.summary
    assert took < 8, f"the goodbyes took {took:.1f}s with etcd down (they share 5 s)"
    handlers[0].leave()


def test_a_node_cut_off_from_etcd_as_its_job_ends_says_goodbye_within_seconds(etcd_server: Any, run_id: str) -> None:
    # A cut link refuses nothing: a request goes unanswered until its timeout. Each goodbye
    # past the 5 s they share still made a whole attempt: 20 s in all with the default request
    # timeout of 5 s (seen). An attempt now waits no longer than the time the goodbyes have
    # left, or _LAST_ATTEMPT once it is spent.
    with TcpProxy("127.0.0.1", etcd_server.options.client_port) as proxy:
        staying = create_handler(_params(etcd_server.endpoint, run_id, 2, 2, **ALL_IN_FIRST))
        ending = create_handler(_params(proxy.endpoint, run_id, 2, 2, request_timeout=5, **ALL_IN_FIRST))
        _join_all([staying, ending])
        publisher = RunPublisher(ending.client, ending.keys, ending.run_lease,
                                 NodeRecord(node_id=ending.node_id, host="h", addr="127.0.0.1", pid=1))
        proxy.set_delay(600)  # nothing comes back
        started = time.monotonic()
        with pytest.raises(EtcdError, match="etcd unreachable for"):
            ending.set_finished()
        with pytest.raises(EtcdError, match="etcd unreachable for"):
            publisher.update(state="succeeded")
        assert ending.shutdown() is False
        took = time.monotonic() - started
        assert took < 8, f"the goodbyes took {took:.1f}s over a cut link (they share 5 s)"
        staying.shutdown()


def test_rounds_form_for_many_nodes_with_few_requests_each(etcd_server: Any, run_id: str) -> None:
    n = 32
    handlers = _handlers(etcd_server.endpoint, run_id, n, n, n)
    before = _kv_requests(etcd_server.endpoint)
    infos = _join_all(handlers)
    after = _kv_requests(etcd_server.endpoint)
    assert sorted(i.rank for i in infos) == list(range(n))
    # One join transaction per node; the closer adds a read and the round's write.
    assert after - before <= n + 4, f"{after - before} key-value requests for {n} nodes"
    _shutdown(*handlers)


def test_a_node_whose_lease_expires_while_it_waits_registers_again(etcd_server: Any, run_id: str,
                                                                   etcd_client: Any) -> None:
    first, second = _handlers(etcd_server.endpoint, run_id, 2, 2, 2, **SHORT_LEASE)
    keys = RunKeys.of(run_id)

    def registered() -> bool:
        return bool(kv.range_(etcd_client, keys.member(first.node_id), what="test")[1])

    waiting = ThreadPoolExecutor(1).submit(first.next_rendezvous)
    _eventually(registered, 10, "the first node registers")
    old_lease = first._alive.id
    etcd_client.call(lambda c: c.revoke_lease(old_lease))  # as if etcd had expired it
    _eventually(lambda: registered() and first._alive.id != old_lease, 10,
                "the waiting node registers again under a new lease")
    infos = [second.next_rendezvous(), waiting.result(timeout=10)]
    assert {i.world_size for i in infos} == {2}
    _shutdown(first, second)


def test_a_read_older_than_the_watchs_last_event_does_not_undo_it(etcd_server: Any, run_id: str,
                                                                   etcd_client: Any) -> None:
    # A node that joins reads the control keys in its join transaction; a round formed right
    # after that read can arrive by the watch before the node applies the read. The older read
    # must not replace the newer round: the node would wait for it forever.
    from elastictrain.rendezvous.membership import ControlView
    from elastictrain.rendezvous.records import encode

    keys = RunKeys.of(run_id)
    view = ControlView(etcd_client, keys)
    revision, kvs = kv.range_(etcd_client, keys.ctl, prefix=True, what="test")
    view.load(kvs, revision)  # starts the watch
    stale_revision, stale = kv.range_(etcd_client, keys.ctl, prefix=True, what="test")  # the join's read
    record = RoundRecord(round=0, nodes=["a"], nproc=[1], master_addr="127.0.0.1", master_port=1, snapshot=0,
                         min_nodes=1, max_nodes=1, formed_at=time.time())
    kv.txn(etcd_client, [], [kv.put(keys.round, encode(record))], what="test")
    _eventually(lambda: view.round is not None, 10, "the watch delivers the round")
    view.load(stale, stale_revision)
    try:
        assert view.round is not None and view.round.round == 0, "the older read undid the round the watch delivered"
    finally:
        view.close()


def _leave_while_the_waiting_thread_registers(alone: Etcd3RendezvousHandler, etcd_client: Any, *,
                                              on_the_channel: bool) -> None:
    """Let ``alone`` wait for a round; revoke its lease so that it registers again (a request);
    hold that request, before it takes a channel or (``on_the_channel``) after, while the test
    calls ``leave()``; then require the wait to end as a left rendezvous."""
    real_call = alone.client.call
    held, release = threading.Event(), threading.Event()
    waiter: list[threading.Thread] = []

    def hold() -> None:
        held.set()
        release.wait(10)  # leave() runs meanwhile

    def call(operation: Any, what: str = "etcd request", **kwargs: Any) -> Any:
        if not waiter or threading.current_thread() is not waiter[0] or held.is_set():
            return real_call(operation, what, **kwargs)
        if not on_the_channel:
            hold()
            return real_call(operation, what, **kwargs)

        def on_channel(client: Any) -> Any:
            hold()
            return operation(client)
        return real_call(on_channel, what, **kwargs)

    with ThreadPoolExecutor(1) as pool:
        def wait() -> Any:
            waiter.append(threading.current_thread())
            return alone.next_rendezvous()

        waiting = pool.submit(wait)
        _eventually(lambda: alone.node_id in read_members(etcd_client, alone.keys), 10, "it registered")
        alone.client.call = call  # type: ignore[method-assign]
        lease_id = alone._alive.id
        etcd_client.call(lambda c: c.revoke_lease(lease_id))  # it registers anew: a request
        assert held.wait(10), "the waiting thread made no request"
        alone.leave()
        release.set()
        with pytest.raises(RendezvousClosedError, match="left the rendezvous"):
            waiting.result(timeout=10)


def test_leaving_while_the_waiting_thread_is_in_an_etcd_request_still_ends_it_as_closed(etcd_server: Any, run_id: str,
                                                                                       etcd_client: Any) -> None:
    # leave() closes the etcd client under a waiting thread's request (here: registering anew
    # after etcd expired its lease). That request fails on the closed channel; the wait must
    # end as a left rendezvous, as it does between requests, not with the request's error.
    [alone] = _handlers(etcd_server.endpoint, run_id, 1, 2, 2, join_timeout=20, **SHORT_LEASE)
    _leave_while_the_waiting_thread_registers(alone, etcd_client, on_the_channel=True)


def test_a_waiting_thread_that_leave_overtakes_between_two_requests_registers_nothing_anew(
        etcd_server: Any, run_id: str, etcd_client: Any) -> None:
    # leave() runs after the waiting thread decided to register anew (etcd expired its lease)
    # and before its request. Before, the closed client opened its channel again for that
    # request: the node that had left granted a lease and wrote its member key, and the other
    # nodes counted it as waiting until that lease expired.
    [alone] = _handlers(etcd_server.endpoint, run_id, 1, 2, 2, join_timeout=20, **SHORT_LEASE)
    _leave_while_the_waiting_thread_registers(alone, etcd_client, on_the_channel=False)
    assert alone.node_id not in read_members(etcd_client, alone.keys), "the node registered again after it left"
    with pytest.raises(EtcdError, match="closed"):
        alone.client.call(lambda c: c.status(), what="a request after leave()")


def test_a_node_that_took_the_closer_key_keeps_its_role_when_older_events_of_that_key_arrive_after(
        etcd_server: Any, run_id: str, etcd_client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # A node's control watch lags: it has seen the last closer go, but not yet that another node
    # took the key and gave it up again meanwhile. It takes the free key, and then those older
    # events arrive. Before, they named the other node as closer (the node dropped its role
    # while its key stayed) and then none: no round could form while the node lived.
    keys = RunKeys.of(run_id)
    kv.txn(etcd_client, [], [kv.put(keys.closer, encode(CloserRecord("gone_1")))], what="test")
    [lagging] = _handlers(etcd_server.endpoint, run_id, 1, 2, 2, join_timeout=15)
    view = lagging._control
    deliver = ControlView._on_events
    held: list[tuple[Any, int]] = []
    until: list[int | None] = [None]  # deliver events up to this revision; hold the later ones
    lock = threading.Lock()

    def lagging_watch(self: ControlView, events: Any, revision: int) -> None:
        if self is not view:
            deliver(self, events, revision)
            return
        with lock:
            held.extend((event, revision) for event in events)
            if until[0] is None:
                return
            ready = [(e, r) for e, r in held if e.revision <= until[0]]
            held[:] = [(e, r) for e, r in held if e.revision > until[0]]
        for event, rev in ready:
            deliver(self, [event], rev)

    monkeypatch.setattr(ControlView, "_on_events", lagging_watch)
    pool = ThreadPoolExecutor(2)
    try:
        waiting = pool.submit(lagging.next_rendezvous)
        _eventually(lambda: view.closer == "gone_1", 10, "it registered and sees the closer")
        deleted = kv.txn(etcd_client, [], [kv.delete(keys.closer)], what="test").revision  # the closer goes
        taken = kv.txn(etcd_client, [], [kv.put(keys.closer, encode(CloserRecord("other_2")))], what="test").revision
        kv.txn(etcd_client, [], [kv.delete(keys.closer)], what="test")  # another took it and gave it up
        with lock:
            until[0] = deleted
        lagging_watch(view, [], deleted)  # the lagging node sees the first deletion only
        _eventually(lambda: lagging._closer is not None, 10, "the lagging node takes the free key")
        with lock:
            until[0] = taken
        lagging_watch(view, [], taken)  # then, one at a time, the older events
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline and lagging._closer is not None:
            time.sleep(0.05)
        with lock:
            until[0] = 1 << 62
        lagging_watch(view, [], 0)  # the other's release, and the node's own write
        time.sleep(0.5)
        [late] = _handlers(etcd_server.endpoint, run_id, 1, 2, 2, join_timeout=15)
        assert late.next_rendezvous().world_size == 2
        assert waiting.result(timeout=10).world_size == 2
        _shutdown(lagging, late)
    finally:
        pool.shutdown(wait=False)


def _named_handlers(endpoint: str, run_id: str, names: list[str], monkeypatch: pytest.MonkeyPatch,
                    **conf: Any) -> list[Etcd3RendezvousHandler]:
    handlers = []
    for name in names:
        monkeypatch.setenv(NODE_ENV, name)  # what `--node-name` sets for a node agent
        handlers.append(create_handler(_params(endpoint, run_id, 2, len(names), **conf)))
    return handlers


def test_members_state_the_fault_a_member_said_as_it_asked_for_a_new_round_by_name_and_node_rank(
        etcd_server: Any, run_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 43: the survivors said 'membership change (1 node(s) waiting, gone or re-joining)'."""
    handlers = _named_handlers(etcd_server.endpoint, run_id, ["node0", "node1", "node2"], monkeypatch, **ALL_IN_FIRST)
    _join_all(handlers)
    failing, others = handlers[1], [handlers[0], handlers[2]]
    node_rank = failing.joined.rank_of(failing.node_id)
    failing.say_fault(4, "was killed by SIGKILL")
    again = ThreadPoolExecutor(1).submit(failing.next_rendezvous)
    _eventually(lambda: all(h.seen_faults() for h in others), 10, "the others read the fault it said")
    said = Fault(rank=4, node="node1", node_rank=node_rank, how="was killed by SIGKILL")
    assert [h.seen_faults() for h in others] == [[said], [said]]
    _join_all(others)
    again.result(timeout=10)
    # Read back from the round's members too (a watch may not have delivered it yet).
    assert [h.round_faults() for h in others] == [[said], [said]]
    # Said once: the next request for a round states nothing.
    again = ThreadPoolExecutor(1).submit(failing.next_rendezvous)
    _eventually(lambda: all(h.num_nodes_waiting() >= 1 for h in others), 10, "the others see it again")
    assert [h.seen_faults() for h in others] == [[], []]
    _join_all(others)
    again.result(timeout=10)
    assert [h.round_faults() for h in others] == [[], []]
    _shutdown(*handlers)


def test_a_lost_member_is_stated_by_its_name_node_rank_and_host(etcd_server: Any, run_id: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    handlers = _named_handlers(etcd_server.endpoint, run_id, ["node0", "node1", "node2"], monkeypatch,
                               **SHORT_LEASE, **ALL_IN_FIRST)
    _join_all(handlers)
    dead = handlers[2]
    node_rank = dead.joined.rank_of(dead.node_id)
    dead._alive.close()
    _eventually(lambda: all(h.seen_faults() for h in handlers[:2]), 10, "the survivors see it gone")
    for handler in handlers[:2]:
        (fault,) = handler.seen_faults()
        assert (fault.rank, fault.node, fault.node_rank) == (None, "node2", node_rank)
        assert fault.describe().startswith(f"node2 (node rank {node_rank}) at 127.0.0.1 (pid "), fault.describe()
    _join_all(handlers[:2])
    _shutdown(*handlers[:2])
    dead.leave()
