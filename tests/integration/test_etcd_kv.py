"""etcd requests of :mod:`elastictrain.etcd.kv` against a real etcd."""

from __future__ import annotations

from typing import Any

import pytest

from elastictrain.etcd import kv
from elastictrain.etcd.client import EtcdClient


def test_range_pages_reads_every_key_page_by_page_as_etcd_held_them_at_the_first_page(
        etcd_client: EtcdClient, run_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = f"/test-pages/{run_id}/"
    kv.txn(etcd_client, [], [kv.put(f"{prefix}k{i}", str(i).encode()) for i in range(5)], what="test")
    pages: list[int] = []
    read_range = kv._range

    def range_then_write(client: EtcdClient, op: Any, what: str) -> Any:
        response = read_range(client, op, what)
        pages.append(len(response.kvs))
        if len(pages) == 1:  # between the first page and the next: a key added ahead, another deleted
            kv.txn(client, [], [kv.put(f"{prefix}k2b", b"late"), kv.delete(f"{prefix}k4")], what="test")
        return response

    monkeypatch.setattr(kv, "_range", range_then_write)
    revision, found = kv.range_pages(etcd_client, prefix, page=2, what="test")
    assert pages == [2, 2, 1]
    assert [(item.key, item.value) for item in found] == [(f"{prefix}k{i}", str(i).encode()) for i in range(5)]
    assert revision < kv.range_(etcd_client, prefix, prefix=True, what="test")[0]
