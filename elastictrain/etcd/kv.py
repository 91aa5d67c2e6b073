"""etcd v3 key-value requests built directly from etcd's protobuf messages.

The ``etcd3`` client's own transaction helpers cannot express what the
rendezvous needs: a comparison over a whole key range (etcd >= 3.3), and the
response header's revision of every request (the revision orders events and
fences rounds). This module builds the raw ``etcdserverpb`` messages and sends
them through :meth:`EtcdClient.call`, so retries, failover and error
translation stay in one place.

Every function here is idempotent when retried (reads, puts of a fixed value,
transactions whose comparisons make a second application a no-op), which is
why :meth:`EtcdClient.call` may retry them after an ambiguous failure. An
operation that is not idempotent must make itself so (see
``elastictrain.rendezvous.store``) before it is sent through here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from elastictrain.etcd.client import EtcdClient

__all__ = [
    "KeyValue",
    "TxnResult",
    "compare_create",
    "compare_mod",
    "compare_value",
    "count",
    "delete",
    "get",
    "prefix_end",
    "put",
    "range_",
    "range_pages",
    "txn",
]


def _rpc() -> Any:
    from elastictrain.etcd.client import import_etcd3

    return import_etcd3().etcdrpc


def _b(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def prefix_end(prefix: str | bytes) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``."""
    raw = bytearray(_b(prefix))
    for i in range(len(raw) - 1, -1, -1):
        if raw[i] < 0xFF:
            raw[i] += 1
            return bytes(raw[: i + 1])
    return b"\0"  # every key


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key as etcd stores it (``mvccpb.KeyValue``), decoded to plain Python."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def from_pb(cls, kv: Any) -> KeyValue:
        return cls(kv.key.decode("utf-8", "replace"), bytes(kv.value), int(kv.create_revision),
                   int(kv.mod_revision), int(kv.version), int(kv.lease))


@dataclass(frozen=True, slots=True)
class TxnResult:
    """What a transaction did: which branch ran, at which revision, and what each range read."""

    succeeded: bool
    revision: int
    """The store's revision after the transaction (its own, if it wrote)."""
    ranges: list[list[KeyValue]]
    """The result of each ``get`` of the branch that ran, in order."""
    deleted: list[int]
    """How many keys each ``delete`` of the branch that ran deleted, in order."""
    counts: list[int]
    """How many keys each ``get`` of the branch that ran matched, in order (all of them, also
    with ``count_only``)."""


# --- operations -------------------------------------------------------------------------------


def put(key: str | bytes, value: str | bytes, lease: int = 0) -> Any:
    """A put request, attached to ``lease`` (0: none)."""
    rpc = _rpc()
    return rpc.RequestOp(request_put=rpc.PutRequest(key=_b(key), value=_b(value), lease=lease))


def get(key: str | bytes, *, prefix: bool = False, keys_only: bool = False, count_only: bool = False) -> Any:
    """A range request for ``key`` (or every key under it, with ``prefix``)."""
    rpc = _rpc()
    request = rpc.RangeRequest(key=_b(key), keys_only=keys_only, count_only=count_only)
    if prefix:
        request.range_end = prefix_end(key)
    return rpc.RequestOp(request_range=request)


def delete(key: str | bytes, *, prefix: bool = False) -> Any:
    """A delete request for ``key`` (or every key under it, with ``prefix``)."""
    rpc = _rpc()
    request = rpc.DeleteRangeRequest(key=_b(key))
    if prefix:
        request.range_end = prefix_end(key)
    return rpc.RequestOp(request_delete_range=request)


# --- comparisons ------------------------------------------------------------------------------

_RESULTS = {"==": "EQUAL", "!=": "NOT_EQUAL", "<": "LESS", ">": "GREATER"}


def _compare(key: str | bytes, op: str, target: str, field: str, value: Any, prefix: bool) -> Any:
    rpc = _rpc()
    compare = rpc.Compare(key=_b(key), result=getattr(rpc.Compare, _RESULTS[op]),
                          target=getattr(rpc.Compare, target))
    setattr(compare, field, value)
    if prefix:
        # Compares every key in the range (etcd >= 3.3); a range with no keys compares true.
        compare.range_end = prefix_end(key)
    return compare


def compare_create(key: str | bytes, op: str, revision: int, *, prefix: bool = False) -> Any:
    """Compare the ``create_revision`` of ``key`` (0 when it does not exist) with ``revision``."""
    return _compare(key, op, "CREATE", "create_revision", revision, prefix)


def compare_mod(key: str | bytes, op: str, revision: int, *, prefix: bool = False) -> Any:
    """Compare the ``mod_revision`` of ``key`` (of every key under it, with ``prefix``)."""
    return _compare(key, op, "MOD", "mod_revision", revision, prefix)


def compare_value(key: str | bytes, op: str, value: str | bytes) -> Any:
    """Compare the value of ``key``; a missing key never compares equal."""
    return _compare(key, op, "VALUE", "value", _b(value), False)


# --- requests ---------------------------------------------------------------------------------


def txn(client: EtcdClient, compare: Sequence[Any], success: Sequence[Any], failure: Sequence[Any] = (),
        *, what: str, once: bool = False) -> TxnResult:
    """Send one transaction through ``client`` (retried and failed over like any call).

    Args:
        once: One attempt only (see :meth:`EtcdClient.call`): for a transaction that
            must not be applied twice.

    Raises:
        EtcdError: As :meth:`EtcdClient.call` (``EtcdIndeterminateError`` with ``once``).
    """
    rpc = _rpc()
    request = rpc.TxnRequest(compare=list(compare), success=list(success), failure=list(failure))

    def send(c: Any) -> Any:
        return c.kvstub.Txn(request, c.timeout, credentials=c.call_credentials, metadata=c.metadata)

    response = client.call(send, what=what, once=once)
    reads = [op.response_range for op in response.responses if op.WhichOneof("response") == "response_range"]
    ranges = [[KeyValue.from_pb(kv) for kv in read.kvs] for read in reads]
    deleted = [int(op.response_delete_range.deleted)
               for op in response.responses if op.WhichOneof("response") == "response_delete_range"]
    return TxnResult(bool(response.succeeded), int(response.header.revision), ranges, deleted,
                     [int(read.count) for read in reads])


def range_(client: EtcdClient, key: str | bytes, *, prefix: bool = False, keys_only: bool = False,
           what: str) -> tuple[int, list[KeyValue]]:
    """Read ``key`` (or every key under it): the store revision of the read, and the keys.

    Raises:
        EtcdError: As :meth:`EtcdClient.call`.
    """
    response = _range(client, get(key, prefix=prefix, keys_only=keys_only), what)
    return int(response.header.revision), [KeyValue.from_pb(kv) for kv in response.kvs]


def range_pages(client: EtcdClient, prefix: str | bytes, *, page: int, what: str) -> tuple[int, list[KeyValue]]:
    """Every key under ``prefix``, ``page`` keys a request, each page read at the revision of the
    first: the revision and the keys. One request unless there are more than ``page`` keys, and
    no response grows past what gRPC takes (4 MB).

    Raises:
        EtcdError: As :meth:`EtcdClient.call` (also when etcd compacted that revision meanwhile).
    """
    rpc = _rpc()
    start, end = _b(prefix), prefix_end(prefix)
    revision = 0
    found: list[KeyValue] = []
    while True:
        request = rpc.RangeRequest(key=start, range_end=end, limit=page, revision=revision)
        response = _range(client, rpc.RequestOp(request_range=request), what)
        revision = revision or int(response.header.revision)
        found.extend(KeyValue.from_pb(kv) for kv in response.kvs)
        if not response.more or not response.kvs:
            return revision, found
        start = bytes(response.kvs[-1].key) + b"\0"


def count(client: EtcdClient, prefix: str | bytes, *, what: str) -> int:
    """How many keys start with ``prefix``: etcd answers with the number alone, not the keys.

    Raises:
        EtcdError: As :meth:`EtcdClient.call`.
    """
    return int(_range(client, get(prefix, prefix=True, count_only=True), what).count)


def _range(client: EtcdClient, op: Any, what: str) -> Any:
    request = op.request_range

    def send(c: Any) -> Any:
        return c.kvstub.Range(request, c.timeout, credentials=c.call_credentials, metadata=c.metadata)

    return client.call(send, what=what)
