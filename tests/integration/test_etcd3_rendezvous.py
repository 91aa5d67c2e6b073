"""torch's DynamicRendezvousHandler on the etcd3 backend: several nodes in one process."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous import dynamic_rendezvous

import elastictrain.rendezvous  # noqa: F401 - registers "etcd3"
from elastictrain.rendezvous import _state_watch


def _params(endpoint: str, run_id: str, min_nodes: int, max_nodes: int, **conf: Any) -> RendezvousParameters:
    conf = {"last_call_timeout": 0.5, "keep_alive_interval": 1, "request_timeout": 2, **conf}
    return RendezvousParameters("etcd3", endpoint, run_id, min_nodes, max_nodes, local_addr="127.0.0.1", **conf)


def _join_all(handlers: list[Any]) -> list[Any]:
    with ThreadPoolExecutor(len(handlers)) as pool:
        return list(pool.map(lambda h: h.next_rendezvous(), handlers))


def test_registry_builds_etcd3_handler(etcd_server: Any, run_id: str) -> None:
    handler = rendezvous_handler_registry.create_handler(_params(etcd_server.endpoint, run_id, 1, 1))
    assert handler.get_backend() == "etcd3"
    assert handler.use_agent_store is False
    handler.shutdown()


def test_nodes_rendezvous_with_distinct_ranks_and_fresh_store_per_round(etcd_server: Any, run_id: str) -> None:
    n = 4
    handlers = [rendezvous_handler_registry.create_handler(_params(etcd_server.endpoint, run_id, n, n))
                for _ in range(n)]
    infos = _join_all(handlers)
    assert sorted(i.rank for i in infos) == list(range(n))
    assert {i.world_size for i in infos} == {n}
    ports = {i.bootstrap_store_info.master_port for i in infos}
    assert len(ports) == 1
    # Round 0's keys are invisible to round 1.
    infos[0].store.set("seen", "round0")
    for h in handlers:
        h._state_holder.state.complete = False  # noqa: SLF001 - force a new round locally
    second = _join_all(handlers)
    assert {i.world_size for i in second} == {n}
    assert not second[0].store.check(["seen"])
    for h in handlers:
        h.shutdown()


def test_a_waiting_node_is_woken_by_the_state_change_not_the_poll(etcd_server: Any, run_id: str) -> None:
    # min 2: the first node waits in torch's poll loop until the second one joins.
    # Each wait must end because etcd reported a newer state, not because torch's
    # one-second poll period ran out.
    handlers = [rendezvous_handler_registry.create_handler(
        _params(etcd_server.endpoint, run_id, 2, 2)) for _ in range(2)]
    watch = handlers[0]._watch  # noqa: SLF001
    outcomes: list[bool] = []
    original = watch.wait_newer
    watch.wait_newer = lambda than, timeout: outcomes.append(original(than, timeout)) or outcomes[-1]
    first = ThreadPoolExecutor(1).submit(handlers[0].next_rendezvous)
    while not outcomes:  # the first node has entered its wait loop
        time.sleep(0.05)
    second = handlers[1].next_rendezvous()
    infos = [first.result(timeout=30), second]
    assert sorted(i.rank for i in infos) == [0, 1]
    assert outcomes[-1] is True, f"the last wait timed out instead of waking: {outcomes}"
    for h in handlers:
        h.shutdown()


def test_delay_hook_leaves_other_threads_alone() -> None:
    _state_watch.install()
    calls: list[float] = []
    started = time.monotonic()
    dynamic_rendezvous._delay(0.2)  # noqa: SLF001 - not inside an etcd3 operation: plain sleep
    assert time.monotonic() - started >= 0.2
    with _state_watch.waiting_on(calls.append):
        dynamic_rendezvous._delay(1)  # noqa: SLF001
        dynamic_rendezvous._delay((0, 0.01))  # noqa: SLF001 - jitter keeps torch's meaning
    assert calls == [1]


def test_closed_rendezvous_is_reported_to_a_late_node(etcd_server: Any, run_id: str) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousClosedError

    handler = rendezvous_handler_registry.create_handler(_params(etcd_server.endpoint, run_id, 1, 1))
    handler.next_rendezvous()
    handler.set_closed()
    late = rendezvous_handler_registry.create_handler(_params(etcd_server.endpoint, run_id, 1, 1))
    assert late.is_closed()
    with pytest.raises(RendezvousClosedError):
        late.next_rendezvous()
    handler.shutdown()


# A heartbeat window of 2 s (0.5 s x 4, the shortest allowed) keeps the two tests below short.
_SHORT_WINDOW = {"keep_alive_interval": 0.5, "keep_alive_max_attempt": 4, "retry_deadline": 20}


def _eventually(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout:g}s: {what}")
        time.sleep(0.1)


def test_an_etcd_outage_longer_than_the_heartbeat_window_drops_no_live_node(private_etcd: Any, run_id: str) -> None:
    # Every heartbeat lapses while etcd is down. When it returns, the first node to
    # sync must not judge its peers (nor itself) dead for a gap nobody could avoid:
    # torch's _sanitize would drop every participant and open an empty round that no
    # training node ever re-enters, so a later node could never join.
    handlers = [rendezvous_handler_registry.create_handler(
        _params(private_etcd.endpoint, run_id, 2, 3, **_SHORT_WINDOW)) for _ in range(2)]
    infos = _join_all(handlers)
    round_before = handlers[0].round
    private_etcd.kill()
    time.sleep(4)  # two heartbeat windows
    private_etcd.start()
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:  # the heartbeat threads resume meanwhile
        assert [h.num_nodes_waiting() for h in handlers] == [0, 0]
        time.sleep(0.2)
    state = handlers[0]._state_holder.state  # noqa: SLF001
    assert state.round == round_before and state.complete
    assert set(map(repr, state.participants)) == {h.node_id for h in handlers}

    late = rendezvous_handler_registry.create_handler(
        _params(private_etcd.endpoint, run_id, 2, 3, **_SHORT_WINDOW))
    joining = ThreadPoolExecutor(1).submit(late.next_rendezvous)
    _eventually(lambda: all(h.num_nodes_waiting() == 1 for h in handlers), 10, "the late node is seen waiting")
    second = _join_all(handlers)
    assert {i.world_size for i in [*second, joining.result(timeout=30)]} == {3}
    assert infos[0].world_size == 2
    for h in [*handlers, late]:
        h.shutdown()


def test_a_node_dropped_from_its_round_rejoins_when_another_node_rendezvouses(etcd_server: Any, run_id: str) -> None:
    # However a training node's heartbeats lapsed (a stalled agent, a cut link), once
    # the rendezvous has moved past its round, a node rendezvousing there is waiting
    # for it: the training node must count it, so that its agent restarts and rejoins.
    handlers = [rendezvous_handler_registry.create_handler(
        _params(etcd_server.endpoint, run_id, 2, 3, **_SHORT_WINDOW)) for _ in range(2)]
    _join_all(handlers)
    round_before = handlers[0].round
    for h in handlers:
        h._stop_heartbeats()  # noqa: SLF001 - as if the agent had stalled
    time.sleep(3)
    assert [h.num_nodes_waiting() for h in handlers] == [0, 0]  # nobody else is here yet

    late = rendezvous_handler_registry.create_handler(_params(etcd_server.endpoint, run_id, 2, 3, **_SHORT_WINDOW))
    joining = ThreadPoolExecutor(1).submit(late.next_rendezvous)
    # The late node drops the two silent ones and opens the next round, alone in it.
    _eventually(lambda: late.round > round_before, 10, "the late node opens the next round")
    _eventually(lambda: all(h.num_nodes_waiting() >= 1 for h in handlers), 10,
                "the dropped nodes see a node waiting for them")
    second = _join_all(handlers)
    assert {i.world_size for i in [*second, joining.result(timeout=30)]} == {3}
    for h in [*handlers, late]:
        h.shutdown()
