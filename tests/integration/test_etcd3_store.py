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
from elastictrain.rendezvous.etcd3_store import Etcd3Store


@pytest.fixture
def store(etcd_client: Any, run_id: str) -> Etcd3Store:
    return Etcd3Store(etcd_client, run_id, RunLease(etcd_client, timedelta(seconds=60)), timeout=timedelta(seconds=5))


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


def test_add_is_atomic_across_threads(store: Etcd3Store) -> None:
    def bump() -> None:
        for _ in range(10):
            store.add("counter", 1)

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.add("counter", 0) == 40


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
    assert store.get("a") == b"1x"
    assert store.num_keys() == 2
    assert store.delete_key("a") and not store.delete_key("a")
    assert store.num_keys() == 1


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
    bases = [Etcd3Store(etcd_client, run_id, lease) for _ in range(2)]
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
