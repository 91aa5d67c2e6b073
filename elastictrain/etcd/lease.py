"""``RunLease``: the etcd lease a process attaches its keys to, refreshed lazily."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

from elastictrain.errors import ConfigError, EtcdError
from elastictrain.etcd.client import EtcdClient

logger = logging.getLogger(__name__)

__all__ = ["RunLease"]

_T = TypeVar("_T")


class RunLease:
    """A lease that the keys of one process are attached to, refreshed lazily.

    Writers call :meth:`id` before each put; it grants a lease the first time and
    refreshes it once a quarter of its TTL has passed. A process that stops
    writing stops refreshing, so the keys it wrote last expire after the TTL
    unless a live process rewrote them (attaching them to its own lease).
    """

    def __init__(self, client: EtcdClient, ttl: timedelta) -> None:
        if ttl.total_seconds() < 2:
            raise ConfigError(f"lease TTL must be at least 2 s, got {ttl.total_seconds():g} s")
        self._client = client
        self._ttl = int(ttl.total_seconds())
        self._lock = threading.Lock()
        self._lease_id: int | None = None
        self._refreshed_at = 0.0

    def id(self) -> int:
        with self._lock:
            now = time.monotonic()
            if self._lease_id is not None and now - self._refreshed_at < self._ttl / 4:
                return self._lease_id
            if self._lease_id is not None:
                responses = self._client.call(
                    lambda c: list(c.refresh_lease(self._lease_id)), what="a lease refresh"
                )
                # TTL 0 (or -1) means etcd forgot the lease: it expired or etcd lost its data.
                if responses and responses[0].TTL > 0:
                    self._refreshed_at = now
                    return self._lease_id
                logger.warning("etcd lease %x expired; granting a new one", self._lease_id)
            lease = self._client.call(lambda c: c.lease(self._ttl), what="a lease grant")
            self._lease_id = lease.id
            self._refreshed_at = now
            return lease.id

    def forget(self) -> None:
        """Drop the cached lease id (etcd no longer knows it); the next :meth:`id` grants anew."""
        with self._lock:
            self._lease_id = None

    def write(self, operation: Callable[[int], _T]) -> _T:
        """Run ``operation(lease_id)``, granting a new lease once if etcd lost ours.

        Raises:
            EtcdError: As :meth:`EtcdClient.call`.
        """
        try:
            return operation(self.id())
        except EtcdError as exc:
            if "lease not found" not in str(exc):
                raise
            logger.warning("etcd lost lease of this process (%s); granting a new one", exc)
            self.forget()
            return operation(self.id())

    def revoke(self) -> None:
        """Drop the lease now; keys last written by this process go with it."""
        with self._lock:
            lease_id, self._lease_id = self._lease_id, None
        if lease_id is not None:
            self._client.call(lambda c: c.revoke_lease(lease_id), what="a lease revoke")
