"""A lease etcd no longer knows is told by its gRPC status (NOT_FOUND), as
:class:`~elastictrain.errors.EtcdLeaseNotFoundError`, and the lease holders act on that type."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import pytest

from elastictrain import errors
from elastictrain.etcd import kv
from elastictrain.etcd.lease import KeptLease, RunLease

pytestmark = pytest.mark.timeout(60)


def _revoked_lease(etcd_client: Any) -> int:
    lease = etcd_client.call(lambda c: c.lease(60))
    etcd_client.call(lambda c: c.revoke_lease(lease.id))
    return int(lease.id)


def test_a_write_under_a_revoked_lease_raises_lease_not_found(etcd_client: Any, run_id: str) -> None:
    lease_id = _revoked_lease(etcd_client)
    with pytest.raises(errors.EtcdLeaseNotFoundError) as raised:
        kv.txn(etcd_client, [], [kv.put(f"/{run_id}/k", b"v", lease_id)], [], what="writing")
    # What it was raised as before it had a type: callers that catch that still do.
    assert isinstance(raised.value, errors.EtcdUnavailableError)
    assert "requested lease not found" in str(raised.value)
    with pytest.raises(errors.EtcdLeaseNotFoundError):
        etcd_client.call(lambda c: c.revoke_lease(lease_id), what="revoking again")


def test_other_failures_are_not_lease_not_found(etcd_client: Any, run_id: str) -> None:
    with pytest.raises(errors.EtcdUnavailableError) as raised:  # etcd refuses a put without a key
        kv.txn(etcd_client, [], [kv.put("", b"v")], [], what="writing no key")
    assert not isinstance(raised.value, errors.EtcdLeaseNotFoundError)


def test_revoking_a_lease_etcd_already_forgot_is_no_warning(etcd_client: Any, caplog: Any) -> None:
    kept = KeptLease(etcd_client, timedelta(seconds=10), interval=timedelta(seconds=5), name="test lease")
    lease_id = kept.grant()
    etcd_client.call(lambda c: c.revoke_lease(lease_id))  # as if etcd had expired it
    with caplog.at_level(logging.DEBUG, logger="elastictrain.etcd.lease"):
        kept.revoke()
    # revoke's own lines: the keep-alive sent as the lease was added may meet the lease gone and say
    # so, truly, as a warning (it did, once, at load 8).
    said = [(r.levelno, r.getMessage()) for r in caplog.records
            if r.name == "elastictrain.etcd.lease" and r.funcName == "revoke"]
    assert said and all(level == logging.DEBUG for level, _ in said), said
    assert "was already gone" in said[-1][1]


def test_a_run_lease_etcd_forgot_is_acquired_anew_on_the_next_write(etcd_client: Any, run_id: str,
                                                                    caplog: Any) -> None:
    lease = RunLease(etcd_client, timedelta(seconds=60))
    old = lease.id()
    etcd_client.call(lambda c: c.revoke_lease(old))  # then kept alive: etcd answers TTL 0, later
    key = f"/{run_id}/k"
    with caplog.at_level(logging.WARNING, logger="elastictrain.etcd.lease"):
        lease.write(lambda lease_id: kv.txn(etcd_client, [], [kv.put(key, b"v", lease_id)], [], what="writing"))
    assert lease.id() != old
    assert any("etcd lost the run lease" in r.getMessage() for r in caplog.records)
    assert kv.range_(etcd_client, key, what="reading")[1][0].lease == lease.id()
    lease.revoke()


def test_a_run_lease_write_passes_other_etcd_errors_through(etcd_client: Any) -> None:
    lease = RunLease(etcd_client, timedelta(seconds=60))
    calls = []

    def fails(lease_id: int) -> None:
        calls.append(lease_id)
        raise errors.EtcdError("something else")

    with pytest.raises(errors.EtcdError, match="something else"):
        lease.write(fails)
    assert len(calls) == 1  # not retried under a new lease
    lease.revoke()
