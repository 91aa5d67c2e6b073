"""etcd leases kept alive by this process: a node's liveness, and the run's shared keys.

A lease lives on the etcd server: it expires when nobody has refreshed it for
its TTL, judged by the server's own clock, and every key attached to it is
deleted at that moment. That makes a lease the way to say "this process is
alive" without comparing clocks of different hosts.

- :class:`KeptLease` holds one lease, refreshed over etcd's keep-alive stream;
  when etcd says the lease is gone it is marked lost (and a callback runs). All
  leases of one client share one stream and one thread (a :class:`KeepAliveHub`,
  as etcd's Go client does): a Python gRPC stream costs CPU even when idle.
- :class:`RunLease` is the lease of a run's shared keys (rendezvous rounds, the
  store, status records). One lease per run, its id published under the run's
  prefix; every live node keeps it alive, so the keys live as long as any node
  does and expire a TTL after the last one is gone.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, TypeVar

from elastictrain import errors
from elastictrain.errors import ConfigError, EtcdError
from elastictrain.etcd import kv
from elastictrain.etcd.client import EtcdClient, import_etcd3

logger = logging.getLogger(__name__)
_JITTER = random.Random()  # never the global one: a trainer's random numbers are its own

__all__ = ["KeepAliveHub", "KeptLease", "RunLease"]

_T = TypeVar("_T")
_BACKOFF_FIRST = 0.05
_BACKOFF_MAX = 1.0
_REVOKE_DEADLINE = timedelta(seconds=2)
"""How long :meth:`KeptLease.revoke` tries: a process that leaves must not wait out the retry
deadline on an unreachable etcd (a scheduler's grace period, 30 s in Kubernetes, would kill
it first), and the lease expires after its TTL anyway."""


class KeepAliveHub:
    """The one keep-alive stream of an :class:`EtcdClient`, shared by all its :class:`KeptLease` s.

    One thread holds the stream: it sends each lease's keep-alive when it falls due and
    reads etcd's answers (a TTL of 0 means the lease is gone). When the stream breaks it
    reopens it, on the next endpoint if need be, and sends every keep-alive at once.
    """

    def __init__(self, client: EtcdClient) -> None:
        self._client = client
        self._cond = threading.Condition()
        self._leases: dict[int, KeptLease] = {}
        self._due: dict[int, float] = {}
        self._closed = False
        self._thread: threading.Thread | None = None

    def add(self, lease: KeptLease, lease_id: int) -> None:
        with self._cond:
            if self._closed:  # its client was closed
                return
            self._leases[lease_id] = lease
            self._due[lease_id] = 0.0  # at once
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="elastictrain-keepalive", daemon=True)
                self._thread.start()

    def remove(self, lease_id: int) -> None:
        with self._cond:
            self._leases.pop(lease_id, None)
            self._due.pop(lease_id, None)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._leases.clear()
            self._cond.notify_all()

    def _requests(self, done: threading.Event) -> Iterator[Any]:
        rpc = import_etcd3().etcdrpc
        with self._cond:
            for lease_id in self._due:  # a new stream: every keep-alive at once
                self._due[lease_id] = 0.0
        while True:
            with self._cond:
                if self._closed or done.is_set():
                    return
                now = time.monotonic()
                due = [i for i, at in self._due.items() if at <= now]
                for lease_id in due:
                    self._due[lease_id] = now + self._leases[lease_id].interval
                if not due:
                    wake = min(self._due.values(), default=now + 1.0)
                    self._cond.wait(max(0.0, min(wake - now, 1.0)))
                    continue
            for lease_id in due:
                yield rpc.LeaseKeepAliveRequest(ID=lease_id)

    def _run(self) -> None:
        import grpc

        rpc = import_etcd3().etcdrpc
        backoff = _BACKOFF_FIRST
        while True:
            with self._cond:
                if self._closed:
                    return
            done = threading.Event()
            call, index, client = None, self._client.current_index, None
            try:
                index, client = self._client.stream_client()
                call = rpc.LeaseStub(client.channel).LeaseKeepAlive(
                    self._requests(done), credentials=client.call_credentials, metadata=client.metadata)
                for response in call:
                    backoff = _BACKOFF_FIRST
                    if response.TTL <= 0:
                        with self._cond:
                            lease = self._leases.pop(response.ID, None)
                            self._due.pop(response.ID, None)
                        if lease is not None:
                            lease.mark_lost()
            except grpc.RpcError as exc:
                with self._cond:
                    if self._closed:
                        return
                logger.debug("keep-alive stream broke (%s); reopening", exc)
                self._client.stream_failed(index, client, exc)
            except ValueError as exc:  # channel closed by a failover elsewhere
                logger.debug("keep-alive stream: channel closed (%s); reopening", exc)
            except EtcdError as exc:  # no client could be built (e.g. a bad certificate)
                logger.debug("cannot open a keep-alive stream: %s", exc)
            finally:
                done.set()
                with self._cond:
                    self._cond.notify_all()
                if call is not None:
                    call.cancel()
            with self._cond:
                if self._closed:
                    return
                self._cond.wait(backoff * _JITTER.uniform(0.5, 1.0))
            backoff = min(backoff * 2, _BACKOFF_MAX)


class KeptLease:
    """A lease refreshed every ``interval`` (over its client's keep-alive stream) until closed.

    Args:
        client: The etcd front.
        ttl: The lease's time to live (whole seconds; at least 2 s). etcd may round
            it up to its minimum (1.5 x its election timeout).
        interval: Time between keep-alive messages; a TTL of 5 s refreshed every
            second tolerates four lost or late refreshes before etcd expires it.
        name: Names the lease in log lines.
        on_lost: Called (on the keep-alive thread) once etcd says the lease expired.
    """

    def __init__(self, client: EtcdClient, ttl: timedelta, *, interval: timedelta, name: str = "lease",
                 on_lost: Callable[[], None] | None = None) -> None:
        if ttl.total_seconds() < 2:
            raise ConfigError(f"lease TTL must be at least 2 s, got {ttl.total_seconds():g} s")
        if not 0 < interval.total_seconds() < ttl.total_seconds():
            raise ConfigError(f"the keep-alive interval ({interval.total_seconds():g} s) must be positive "
                              f"and shorter than the lease TTL ({ttl.total_seconds():g} s)")
        self._client = client
        self.ttl = int(round(ttl.total_seconds()))
        self.interval = interval.total_seconds()
        self._name = name
        self._on_lost = on_lost
        self._lock = threading.Lock()
        self._id: int | None = None
        self._lost = False
        self._closed = False
        self.granted_ttl: int | None = None
        """The TTL etcd granted (it may round a short one up)."""

    @property
    def id(self) -> int | None:
        """The lease id, or ``None`` before :meth:`grant`/:meth:`adopt`."""
        return self._id

    @property
    def lost(self) -> bool:
        """True once etcd said the lease no longer exists."""
        return self._lost

    def grant(self, what: str | None = None) -> int:
        """Grant a new lease (replacing a lost one) and keep it alive.

        Args:
            what: Names the request in errors (default: granting the lease).

        Raises:
            EtcdError: As :meth:`EtcdClient.call`.
        """
        lease = self._client.call(lambda c: c.lease(self.ttl), what=what or f"granting the {self._name}")
        self.granted_ttl = int(lease.ttl)
        self.adopt(int(lease.id))
        return int(lease.id)

    def adopt(self, lease_id: int) -> None:
        """Keep ``lease_id`` alive from now on (a lease another process may have granted)."""
        with self._lock:
            previous, self._id, self._lost = self._id, lease_id, False
            closed = self._closed
        hub = self._client.keepalive_hub()
        if previous is not None and previous != lease_id:
            hub.remove(previous)
        if not closed:
            hub.add(self, lease_id)

    def revoke(self) -> None:
        """Stop refreshing and delete the lease now: every key attached to it goes with it.

        Tries for about :data:`_REVOKE_DEADLINE` (an attempt under way may take up to the
        request timeout), then gives up with one log line: the lease
        expires after its TTL anyway, and the caller (a node that leaves) must not hang on
        an unreachable etcd.
        """
        with self._lock:
            lease_id, self._id = self._id, None
        if lease_id is not None:
            self._client.keepalive_hub().remove(lease_id)
            try:
                self._client.call(lambda c: c.revoke_lease(lease_id), what=f"revoking the {self._name}",
                                  deadline=_REVOKE_DEADLINE)
            except EtcdError as exc:  # it expires on its own
                if isinstance(exc, errors.EtcdLeaseNotFoundError):  # it has already
                    logger.debug("the %s (%x) was already gone: %s", self._name, lease_id, exc)
                    return
                logger.warning("could not revoke the %s (%x): %s; etcd expires it within its TTL (%d s)",
                               self._name, lease_id, exc, self.granted_ttl or self.ttl)

    def close(self) -> None:
        """Stop refreshing (the lease then expires after its TTL)."""
        with self._lock:
            self._closed = True
            lease_id = self._id
        if lease_id is not None:
            self._client.keepalive_hub().remove(lease_id)

    def mark_lost(self) -> None:
        """Record that etcd no longer knows the lease (a write said so); runs ``on_lost`` once."""
        with self._lock:
            if self._lost:
                return
            self._lost = True
            lease_id = self._id
        if lease_id is not None:
            self._client.keepalive_hub().remove(lease_id)
        logger.warning("etcd expired the %s (%s): etcd did not hear from this process for %d s",
                       self._name, f"{lease_id:x}" if lease_id else "?", self.ttl)
        if self._on_lost is not None:
            try:
                self._on_lost()
            except Exception:
                logger.exception("%s: lost-lease callback failed", self._name)


class RunLease:
    """The lease of a run's shared keys, shared by every node of the run.

    The first node to need it grants it and publishes its id at ``key`` (attached
    to the lease itself); later nodes adopt that id. Each keeps it alive, so the
    run's keys expire ``ttl`` after the last node is gone. Without ``key`` the
    lease is this process's own.

    Args:
        client: The etcd front.
        ttl: How long the keys outlive the last node.
        key: Where the run publishes its lease id (``None``: a private lease).
    """

    def __init__(self, client: EtcdClient, ttl: timedelta, key: str | None = None) -> None:
        self._client = client
        self._key = key
        self._kept = KeptLease(client, ttl, interval=ttl / 8, name="run lease")
        self._lock = threading.Lock()

    def id(self) -> int:
        """The lease id, granted or adopted on first use.

        Raises:
            EtcdError: As :meth:`EtcdClient.call`.
        """
        with self._lock:
            current = self._kept.id
            if current is not None and not self._kept.lost:
                return current
            if self._key is None:
                return self._kept.grant()
            return self._acquire_shared(self._key)

    def _acquire_shared(self, key: str) -> int:
        _, found = kv.range_(self._client, key, what="reading the run lease")
        if found and found[0].value.isdigit():
            self._kept.adopt(int(found[0].value))
            return int(found[0].value)
        mine = self._kept.grant()
        result = kv.txn(self._client, [kv.compare_create(key, "==", 0)], [kv.put(key, str(mine), lease=mine)],
                        [kv.get(key)], what="publishing the run lease")
        if result.succeeded:
            return mine
        theirs = result.ranges[0][0].value if result.ranges and result.ranges[0] else b""
        if not theirs.isdigit():
            return mine  # an unreadable id: keep ours (the key is not attached to it)
        self._kept.revoke()
        self._kept.adopt(int(theirs))
        return int(theirs)

    def forget(self) -> None:
        """etcd no longer knows the lease; the next :meth:`id` grants or adopts anew."""
        with self._lock:
            self._kept.mark_lost()

    def write(self, operation: Callable[[int], _T]) -> _T:
        """Run ``operation(lease_id)``, acquiring a new lease once if etcd lost ours.

        Raises:
            EtcdError: As :meth:`EtcdClient.call`.
        """
        try:
            return operation(self.id())
        except errors.EtcdLeaseNotFoundError as exc:
            logger.warning("etcd lost the run lease (%s); acquiring a new one", exc)
            self.forget()
            return operation(self.id())

    def close(self) -> None:
        """Stop keeping the lease alive (other nodes may still do so)."""
        self._kept.close()

    def revoke(self) -> None:
        """Delete the lease now: every key attached to it goes with it."""
        self._kept.revoke()
