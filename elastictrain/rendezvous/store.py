"""``Etcd3Store``: a c10d :class:`~torch.distributed.Store` over the etcd keys of one round.

The rendezvous hands each round's agents this store (torch's agent assigns
worker ranks and runs its exit barrier through it). Unlike torch's default
c10d store, which lives inside the first agent and dies with it, it depends
on etcd only. Its keys live under ``store/<incarnation>/<round>/``: a later
round, or a later incarnation of the same run id (its keys purged and the run
started again), never reads a previous one's keys.

Exactly once. A request whose reply is lost (a leader change, a dropped
connection) may or may not have been applied, so nothing that changes a
value is retried blindly:

- ``add`` and ``append`` write a new key of their own (a shard under the key,
  named by a random operation id) instead of rewriting the key: repeating the
  write repeats a put of the same shard, which changes nothing. The value is
  the key's ``set`` value plus its shards, in revision order. Many agents
  adding to one counter (a barrier) never conflict.
- ``compare_set`` writes an operation marker in the same transaction, and
  after an ambiguous failure reads the marker to learn whether it applied.

Blocking reads (``get``, ``wait``) wait on an etcd watch, not a poll.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence
from datetime import timedelta

from torch.distributed import DistStoreError, Store

from elastictrain.errors import EtcdIndeterminateError
from elastictrain.etcd import kv
from elastictrain.etcd.client import EtcdClient
from elastictrain.etcd.lease import RunLease
from elastictrain.etcd.watch import Watch, WatchEvent

__all__ = ["Etcd3Store"]

_SHARD = b"\x00+"   # key + _SHARD + kind + op id: one add or append
_ADD, _APPEND = b"a", b"p"
_MARKER = b"\x00op/"  # prefix + _MARKER + op id: a compare_set that was applied
_TXN_KEYS = 60  # two range ops per key, under etcd's default limit of 128 ops per transaction


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def shard_prefix(etcd_key: bytes, kind: bytes) -> bytes:
    return etcd_key + _SHARD + kind


def _int(key: str, value: bytes) -> int:
    try:
        return int(value or b"0")
    except ValueError:
        raise ValueError(f"store key {key!r} holds {value[:20]!r}, which is not an integer") from None


class Etcd3Store(Store):
    """A c10d store whose keys are etcd keys under ``prefix``.

    Args:
        client: The etcd front.
        prefix: Key prefix of this store (``RunKeys.store(incarnation, round)``).
        lease: The run lease the keys are attached to.
        timeout: Default timeout of blocking ``get``/``wait``.
    """

    def __init__(self, client: EtcdClient, prefix: str, lease: RunLease,
                 timeout: timedelta = timedelta(seconds=300)) -> None:
        super().__init__()  # required by the pybind11 trampoline
        self._client = client
        self._lease = lease
        self._prefix = prefix.encode()
        self.set_timeout(timeout)

    @property
    def prefix(self) -> str:
        return self._prefix.decode()

    def _key(self, key: str | bytes) -> bytes:
        return self._prefix + _as_bytes(key)

    # --- writes -------------------------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        etcd_key, data = self._key(key), _as_bytes(value)
        # A set replaces the value: earlier add/append shards go with it.
        self._lease.write(lambda lease: kv.txn(
            self._client, [], [kv.delete(etcd_key + _SHARD, prefix=True), kv.put(etcd_key, data, lease)],
            what=f"store set {key!r}"))

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def add(self, key: str, amount: int) -> int:
        shard = self._write_shard(key, _ADD, str(int(amount)).encode())
        _, [(base, shards)] = self._fetch([key])
        total = _int(key, base.value) if base is not None else 0
        for part in shards:
            if part.key.startswith(shard_prefix(self._key(key), _ADD).decode(errors="replace")):
                total += _int(key, part.value)
            if part.key.encode() == shard:
                return total
        raise DistStoreError(f"store key {key!r} was deleted while adding to it")

    def append(self, key: str, value: str | bytes) -> None:
        self._write_shard(key, _APPEND, _as_bytes(value))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        expected_b, desired_b = _as_bytes(expected), _as_bytes(desired)
        etcd_key = self._key(key)
        marker = self._prefix + _MARKER + uuid.uuid4().hex.encode()
        if expected_b == b"":
            # c10d semantics: an empty expected value also matches a missing key.
            compare = [kv.compare_create(etcd_key, "==", 0)]
        else:
            compare = [kv.compare_value(etcd_key, "==", expected_b)]

        def attempt(lease: int) -> kv.TxnResult:
            return kv.txn(self._client, compare, [kv.put(etcd_key, desired_b, lease), kv.put(marker, b"", lease)],
                          [kv.get(etcd_key)], what=f"store compare_set {key!r}", once=True)

        deadline = time.monotonic() + self._client.settings.retry_deadline.total_seconds()
        while True:
            try:
                result = self._lease.write(attempt)
            except EtcdIndeterminateError:
                if time.monotonic() > deadline:
                    raise
                _, applied = kv.range_(self._client, marker, keys_only=True, what=f"store compare_set {key!r}")
                if applied:
                    return desired_b
                continue  # it did not apply: try again
            if result.succeeded:
                return desired_b
            found = result.ranges[0]
            if not found and expected_b == b"":
                continue  # deleted between the comparison and now: compare again
            return found[0].value if found else expected_b

    def delete_key(self, key: str) -> bool:
        etcd_key = self._key(key)
        result = kv.txn(self._client, [], [kv.delete(etcd_key), kv.delete(etcd_key + _SHARD, prefix=True)],
                        what=f"store delete {key!r}")
        return sum(result.deleted) > 0

    def _write_shard(self, key: str, kind: bytes, value: bytes) -> bytes:
        """Put ``value`` as a new shard of ``key``; returns the shard's etcd key.

        The shard's name is fixed before the first attempt, so a retry after a lost
        reply writes the same key again: the operation counts once.
        """
        shard = shard_prefix(self._key(key), kind) + uuid.uuid4().hex.encode()
        self._lease.write(lambda lease: kv.txn(self._client, [], [kv.put(shard, value, lease)],
                                               what=f"store {'add' if kind == _ADD else 'append'} {key!r}"))
        return shard

    # --- reads --------------------------------------------------------------------------------

    def _fetch(self, keys: Sequence[str]) -> tuple[int, list[tuple[kv.KeyValue | None, list[kv.KeyValue]]]]:
        """Each key's ``set`` value and its shards in write order, and the revision read at
        (the oldest, when the keys took several transactions)."""
        out: list[tuple[kv.KeyValue | None, list[kv.KeyValue]]] = []
        revision = 0
        for start in range(0, len(keys), _TXN_KEYS):
            chunk = keys[start:start + _TXN_KEYS]
            ops = []
            for key in chunk:
                ops += [kv.get(self._key(key)), kv.get(self._key(key) + _SHARD, prefix=True)]
            result = kv.txn(self._client, [], ops, what="store read")
            revision = result.revision if not revision else min(revision, result.revision)
            for i in range(len(chunk)):
                base, shards = result.ranges[2 * i], result.ranges[2 * i + 1]
                out.append((base[0] if base else None, sorted(shards, key=lambda s: s.create_revision)))
        return revision, out

    def _value(self, key: str, base: kv.KeyValue | None, shards: list[kv.KeyValue]) -> bytes | None:
        if base is None and not shards:
            return None
        adds = shard_prefix(self._key(key), _ADD).decode(errors="replace")
        if any(s.key.startswith(adds) for s in shards):  # a counter: its sum
            total = _int(key, base.value) if base is not None else 0
            return str(total + sum(_int(key, s.value) for s in shards if s.key.startswith(adds))).encode()
        return b"".join([base.value] if base is not None else []) + b"".join(s.value for s in shards)

    def _read(self, keys: Sequence[str]) -> tuple[int, list[bytes | None]]:
        revision, found = self._fetch(keys)
        return revision, [self._value(k, base, shards) for k, (base, shards) in zip(keys, found)]

    def get(self, key: str) -> bytes:
        return self._wait_get([key], None)[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._wait_get(keys, None)

    def check(self, keys: list[str]) -> bool:
        return all(v is not None for v in self._read(keys)[1])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_get(keys, timeout)

    def num_keys(self) -> int:
        _, found = kv.range_(self._client, self._prefix, prefix=True, keys_only=True, what="store num_keys")
        names = {f.key.encode()[len(self._prefix):].split(b"\x00", 1)[0] for f in found}
        names.discard(b"")  # operation markers
        return len(names)

    def _wait_get(self, keys: Sequence[str], timeout: timedelta | None) -> list[bytes]:
        limit = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        changed = threading.Event()

        def on_events(events: list[WatchEvent], _revision: int) -> None:
            del events
            changed.set()

        watch: Watch | None = None
        try:
            while True:
                revision, values = self._read(keys)
                missing = [k for k, v in zip(keys, values) if v is None]
                if not missing:
                    return values  # type: ignore[return-value]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    # The error type of c10d's own stores, so torch code handles it alike.
                    raise DistStoreError(
                        f"timed out after {limit:g}s waiting for store keys {missing} under {self.prefix}")
                if watch is None:
                    watch = Watch(self._client, self.prefix, prefix=True, start_revision=revision + 1,
                                  on_events=on_events, name="store-wait").start()
                changed.wait(min(remaining, 1.0))  # re-read at least every second, in case a watch lags
                changed.clear()
        finally:
            if watch is not None:
                watch.close()
