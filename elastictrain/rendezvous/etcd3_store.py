"""``Etcd3Store``: a c10d :class:`~torch.distributed.Store` over etcd v3 keys.

The rendezvous handler hands the agent this store, wrapped by torch in a
``PrefixStore`` named after the rendezvous round, so a restarted or joining
worker never reads a previous round's keys. Unlike torch's default c10d store,
which lives inside the first agent and dies with it, this one depends on etcd
only: any node may die without taking the job's bootstrap data with it.

Keys live under ``/elastictrain/<run_id>/store/`` and are attached to the run's
lease, so an abandoned run's keys expire. Blocking reads poll with a short
back-off: a store read happens a handful of times per rendezvous round, and a
poll survives an etcd restart that would silently kill a watch stream.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from torch.distributed import DistStoreError, Store

from elastictrain.etcd.client import EtcdClient
from elastictrain.etcd.keys import run_prefix
from elastictrain.etcd.lease import RunLease

__all__ = ["Etcd3Store"]

_POLL_FIRST = 0.005
_POLL_MAX = 0.1


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class Etcd3Store(Store):
    """A c10d store whose keys are etcd keys of one run.

    Args:
        client: The etcd front (shared with the rendezvous backend).
        run_id: The run whose namespace holds the keys.
        lease: The lease to attach keys to.
        timeout: Default timeout of blocking ``get``/``wait``.
    """

    def __init__(
        self,
        client: EtcdClient,
        run_id: str,
        lease: RunLease,
        timeout: timedelta = timedelta(seconds=300),
    ) -> None:
        super().__init__()  # required by the pybind11 trampoline
        self._client = client
        self._lease = lease
        self._prefix = run_prefix(run_id) + "store/"
        self.set_timeout(timeout)

    @property
    def prefix(self) -> str:
        return self._prefix

    def _key(self, key: str | bytes) -> bytes:
        return self._prefix.encode() + _as_bytes(key)

    def set(self, key: str, value: str | bytes) -> None:
        etcd_key, data = self._key(key), _as_bytes(value)
        self._lease.write(
            lambda lease_id: self._client.call(
                lambda c: c.put(etcd_key, data, lease=lease_id), what=f"store set {key!r}"
            )
        )

    def get(self, key: str) -> bytes:
        return self._wait_get([key], None)[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._wait_get(keys, None)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        pairs = [(self._key(k), _as_bytes(v)) for k, v in zip(keys, values, strict=True)]

        def put_all(lease_id: int) -> None:
            def attempt(c: Any) -> None:
                tx = c.transactions
                c.transaction(compare=[], success=[tx.put(k, v, lease=lease_id) for k, v in pairs], failure=[])

            self._client.call(attempt, what="store multi_set")

        self._lease.write(put_all)

    def add(self, key: str, amount: int) -> int:
        return int(self._update(key, lambda old: str(int(old or b"0") + amount).encode()))

    def append(self, key: str, value: str | bytes) -> None:
        tail = _as_bytes(value)
        self._update(key, lambda old: (old or b"") + tail)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        expected_b, desired_b = _as_bytes(expected), _as_bytes(desired)
        etcd_key = self._key(key)

        def attempt(lease_id: int) -> bytes:
            def txn(c: Any) -> bytes:
                tx = c.transactions
                if expected_b == b"":
                    # c10d semantics: an empty expected value also matches a missing key.
                    ok, responses = c.transaction(
                        compare=[tx.create(etcd_key) == 0],
                        success=[tx.put(etcd_key, desired_b, lease=lease_id)],
                        failure=[tx.get(etcd_key)],
                    )
                    if ok:
                        return desired_b
                    current = responses[0][0][0]
                    if current != b"":
                        return current
                ok, responses = c.transaction(
                    compare=[tx.value(etcd_key) == expected_b, tx.create(etcd_key) != 0],
                    success=[tx.put(etcd_key, desired_b, lease=lease_id)],
                    failure=[tx.get(etcd_key)],
                )
                if ok:
                    return desired_b
                kvs = responses[0]
                return kvs[0][0] if kvs else expected_b

            return self._client.call(txn, what=f"store compare_set {key!r}")

        return self._lease.write(attempt)

    def delete_key(self, key: str) -> bool:
        etcd_key = self._key(key)
        return bool(self._client.call(lambda c: c.delete(etcd_key), what=f"store delete {key!r}"))

    def num_keys(self) -> int:
        return self._client.call(
            lambda c: sum(1 for _ in c.get_prefix(self._prefix, keys_only=True)),
            what="store num_keys",
        )

    def check(self, keys: list[str]) -> bool:
        return all(v is not None for v in self._read(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_get(keys, timeout)

    def _read(self, keys: Sequence[str]) -> list[bytes | None]:
        etcd_keys = [self._key(k) for k in keys]

        def attempt(c: Any) -> list[bytes | None]:
            tx = c.transactions
            _, responses = c.transaction(compare=[], success=[tx.get(k) for k in etcd_keys], failure=[])
            return [kvs[0][0] if kvs else None for kvs in responses]

        return self._client.call(attempt, what="store read")

    def _wait_get(self, keys: Sequence[str], timeout: timedelta | None) -> list[bytes]:
        limit = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        delay = _POLL_FIRST
        while True:
            values = self._read(keys)
            missing = [k for k, v in zip(keys, values) if v is None]
            if not missing:
                return values  # type: ignore[return-value]
            if time.monotonic() >= deadline:
                # The error type of c10d's own stores, so torch code handles it alike.
                raise DistStoreError(
                    f"timed out after {limit:g}s waiting for store keys {missing} under {self._prefix}"
                )
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, _POLL_MAX)

    def _update(self, key: str, change: Any) -> bytes:
        """Read-modify-write ``key`` atomically (compare on mod revision, retry on conflict)."""
        etcd_key = self._key(key)

        def attempt(lease_id: int) -> bytes:
            def txn(c: Any) -> bytes:
                tx = c.transactions
                while True:
                    value, meta = c.get(etcd_key)
                    new = change(value)
                    compare = [tx.mod(etcd_key) == meta.mod_revision] if value is not None else [
                        tx.create(etcd_key) == 0
                    ]
                    ok, _ = c.transaction(
                        compare=compare, success=[tx.put(etcd_key, new, lease=lease_id)], failure=[]
                    )
                    if ok:
                        return new

            return self._client.call(txn, what=f"store update {key!r}")

        return self._lease.write(attempt)
