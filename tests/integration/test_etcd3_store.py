"""Etcd3Store against a real etcd, directly and wrapped in torch's PrefixStore."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

from elastictrain.etcd.lease import RunLease
from elastictrain.rendezvous.keys import RunKeys
from elastictrain.rendezvous.store import Etcd3Store


def _store(client: Any, run_id: str, round_: int = 0) -> Etcd3Store:
    return Etcd3Store(client, RunKeys.of(run_id).store(7, round_), RunLease(client, timedelta(seconds=60)),
                      timeout=timedelta(seconds=5))


@pytest.fixture
def store(etcd_client: Any, run_id: str) -> Etcd3Store:
    return _store(etcd_client, run_id)


def test_set_then_get_returns_bytes(store: Etcd3Store) -> None:
    store.set("k", "v")
    store.set("b", b"\x00\xff")
    assert store.get("k") == b"v"
    assert store.get("b") == b"\x00\xff"


def test_get_blocks_until_another_thread_sets_the_key(store: Etcd3Store) -> None:
    threading.Timer(0.3, lambda: store.set("late", "here")).start()
    started = time.monotonic()
    assert store.get("late") == b"here"
    assert 0.25 < time.monotonic() - started < 3


def test_wait_times_out_with_dist_store_error(store: Etcd3Store) -> None:
    with pytest.raises(dist.DistStoreError, match="missing"):
        store.wait(["missing"], timedelta(seconds=0.3))


def test_add_counts_every_add_once_and_each_caller_sees_a_distinct_total(store: Etcd3Store) -> None:
    seen: list[int] = []
    lock = threading.Lock()

    def bump() -> None:
        for _ in range(10):
            total = store.add("counter", 1)
            with lock:
                seen.append(total)

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.add("counter", 0) == 40
    assert sorted(seen) == list(range(1, 41))  # a barrier's "am I the last?" is answered once
    assert store.get("counter") == b"40"


def test_add_continues_from_a_set_value_and_set_resets_it(store: Etcd3Store) -> None:
    store.set("n", "5")
    assert store.add("n", 2) == 7
    assert store.add("n", -1) == 6
    store.set("n", "1")
    assert store.get("n") == b"1" and store.add("n", 1) == 2


def test_torchs_agent_barrier_completes_for_many_agents(store: Etcd3Store) -> None:
    from torch.distributed.elastic.utils.store import barrier

    n = 16
    errors: list[BaseException] = []

    def agent() -> None:
        try:
            barrier(store, n, key_prefix="exit/", barrier_timeout=30)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=agent) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)


def test_compare_set_follows_c10d_semantics(store: Etcd3Store) -> None:
    assert store.compare_set("cs", "", "first") == b"first"  # missing key, empty expected: set
    assert store.compare_set("cs", "wrong", "x") == b"first"  # mismatch: current value
    assert store.compare_set("cs", "first", "second") == b"second"
    assert store.compare_set("absent", "something", "x") == b"something"  # missing, non-empty expected
    assert not store.check(["absent"])


def test_check_delete_num_keys_append_and_multi(store: Etcd3Store) -> None:
    store.multi_set(["a", "b"], ["1", "2"])
    assert store.multi_get(["a", "b"]) == [b"1", b"2"]
    assert store.check(["a", "b"]) and not store.check(["a", "zzz"])
    store.append("a", "x")
    store.append("a", "2")
    assert store.get("a") == b"1x2"  # appended in order, never summed
    assert store.num_keys() == 2
    assert store.delete_key("a") and not store.delete_key("a")
    assert store.num_keys() == 1
    many = [f"k{i}" for i in range(150)]  # more keys than one etcd transaction may read
    store.multi_set(many, [str(i) for i in range(150)])
    assert store.multi_get(many) == [str(i).encode() for i in range(150)]


def test_prefix_store_rounds_do_not_see_each_other(store: Etcd3Store) -> None:
    round0 = dist.PrefixStore("torch.rendezvous.run.0", store)
    round1 = dist.PrefixStore("torch.rendezvous.run.1", store)
    round0.set("MASTER_PORT", "1234")
    assert round0.get("MASTER_PORT") == b"1234"
    assert not round1.check(["MASTER_PORT"])
    assert round1.add("n", 2) == 2


def test_rendezvous_store_info_is_exchanged_through_etcd(etcd_client: Any, run_id: str) -> None:
    lease = RunLease(etcd_client, timedelta(seconds=60))
    # Keep the Python stores referenced: a PrefixStore alone does not keep a
    # Python-subclassed store alive (torch then reports "Not implemented").
    bases = [Etcd3Store(etcd_client, RunKeys.of(run_id).store(1, 0), lease) for _ in range(2)]
    stores = [dist.PrefixStore("round.3", base) for base in bases]
    infos: list[Any] = [None, None]

    def build(rank: int) -> None:
        infos[rank] = RendezvousStoreInfo.build(rank, stores[rank], local_addr="127.0.0.1")

    threads = [threading.Thread(target=build, args=(r,)) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert infos[0].master_addr == infos[1].master_addr == "127.0.0.1"
    assert infos[0].master_port == infos[1].master_port > 0


def test_keys_live_under_the_runs_prefix_with_its_lease(store: Etcd3Store, etcd_client: Any) -> None:
    store.set("x", "1")
    value, meta = etcd_client.call(lambda c: c.get(store.prefix + "x"))
    assert value == b"1" and meta.lease_id != 0


def test_stores_of_two_rounds_do_not_see_each_other(etcd_client: Any, run_id: str) -> None:
    round0, round1 = _store(etcd_client, run_id, 0), _store(etcd_client, run_id, 1)
    round0.set("MASTER_ADDR", "old")
    round0.add("n", 1)
    assert not round1.check(["MASTER_ADDR"]) and round1.add("n", 1) == 1
