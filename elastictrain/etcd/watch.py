"""``Watch``: every change to a key range, in order, across etcd restarts and failovers.

etcd sends a watcher each change with its revision. A stream can break (etcd
restarts, a member fails, the connection drops); etcd keeps the history, so a
watch that reopens from the revision after the last event it delivered loses
nothing and repeats nothing. This module owns that loop, on a thread per watch,
with its own stream on the current endpoint of an :class:`EtcdClient`. (The
``etcd3`` client's watcher drops every watch when its stream breaks, and
reopens its stream in a tight loop while etcd is down.)
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from elastictrain.errors import EtcdError
from elastictrain.etcd.client import EtcdClient, import_etcd3
from elastictrain.etcd.kv import KeyValue, prefix_end

logger = logging.getLogger(__name__)

__all__ = ["Watch", "WatchEvent"]

_BACKOFF_FIRST = 0.05
_BACKOFF_MAX = 1.0


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change: a put (``kv`` is the new key-value) or a delete (``kv.value`` is empty)."""

    deleted: bool
    kv: KeyValue

    @property
    def key(self) -> str:
        return self.kv.key

    @property
    def revision(self) -> int:
        """The revision of the change (for a delete, the revision that deleted the key)."""
        return self.kv.mod_revision


class Watch:
    """Deliver the changes of ``key`` (or every key under it) from ``start_revision`` on.

    Args:
        client: The etcd front; its current endpoint carries the stream.
        key: The key, or the prefix with ``prefix=True``.
        prefix: Watch every key that starts with ``key``.
        start_revision: The first revision to deliver (usually a read's revision + 1).
        on_events: Called on the watch thread with each batch of events, in revision
            order, and the store revision the batch was sent at. An exception it raises
            is logged; the watch goes on.
        on_compacted: Called when etcd no longer holds ``start_revision`` (compacted):
            re-read the range and return the revision the read saw; the watch resumes
            after it. Without it, the watch resumes at the compaction point.
        name: Names the thread and the log lines.
    """

    def __init__(
        self,
        client: EtcdClient,
        key: str,
        *,
        prefix: bool = False,
        start_revision: int,
        on_events: Callable[[list[WatchEvent], int], None],
        on_compacted: Callable[[], int] | None = None,
        name: str = "watch",
    ) -> None:
        self._client = client
        self._key = key.encode()
        self._range_end = prefix_end(key) if prefix else b""
        self._next = max(1, start_revision)
        self._on_events = on_events
        self._on_compacted = on_compacted
        self._name = name
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._call: Any = None
        self._thread = threading.Thread(target=self._run, name=f"elastictrain-{name}", daemon=True)

    def start(self) -> Watch:
        self._thread.start()
        return self

    @property
    def next_revision(self) -> int:
        """The revision the watch delivers next."""
        return self._next

    def close(self) -> None:
        """Stop delivering events; returns once the thread has ended (or after one second)."""
        self._closed.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=1.0)

    def _requests(self, start: int, done: threading.Event) -> Iterator[Any]:
        rpc = import_etcd3().etcdrpc
        create = rpc.WatchCreateRequest(key=self._key, start_revision=start)
        if self._range_end:
            create.range_end = self._range_end
        yield rpc.WatchRequest(create_request=create)
        done.wait()  # the request stream stays open while this stream lives

    def _run(self) -> None:
        import grpc

        rpc = import_etcd3().etcdrpc
        backoff = _BACKOFF_FIRST
        while not self._closed.is_set():
            done = threading.Event()
            call, index = None, self._client.current_index
            try:
                index, client = self._client.stream_client()
                call = rpc.WatchStub(client.channel).Watch(
                    self._requests(self._next, done), credentials=client.call_credentials, metadata=client.metadata)
                with self._lock:
                    self._call = call
                if self._closed.is_set():
                    return
                for response in call:
                    if response.compact_revision:
                        self._resume_after_compaction(int(response.compact_revision))
                        break
                    if response.canceled:
                        logger.debug("%s: etcd cancelled the watch (%s)", self._name, response.cancel_reason)
                        break
                    if response.created:
                        backoff = _BACKOFF_FIRST
                    if response.events:
                        self._deliver(response)
            except grpc.RpcError as exc:
                if self._closed.is_set():
                    return
                logger.debug("%s: stream broke (%s); reopening from revision %d", self._name, exc, self._next)
                self._client.stream_failed(index, exc)
            except ValueError as exc:  # the channel was closed under us (a failover elsewhere)
                logger.debug("%s: channel closed (%s); reopening", self._name, exc)
            except EtcdError as exc:  # no client could be built (e.g. a bad certificate)
                logger.debug("%s: cannot open a watch stream: %s", self._name, exc)
            finally:
                done.set()
                if call is not None:
                    call.cancel()
            if self._closed.wait(backoff * random.uniform(0.5, 1.0)):
                return
            backoff = min(backoff * 2, _BACKOFF_MAX)

    def _deliver(self, response: Any) -> None:
        events = [WatchEvent(bool(e.type == 1), KeyValue.from_pb(e.kv)) for e in response.events]
        fresh = [e for e in events if e.revision >= self._next]  # never deliver one twice
        if fresh:
            self._next = fresh[-1].revision + 1
            try:
                self._on_events(fresh, int(response.header.revision))
            except Exception:  # noqa: BLE001 - a failing consumer must not end the watch
                logger.exception("%s: event handler failed", self._name)

    def _resume_after_compaction(self, compacted: int) -> None:
        if self._on_compacted is None:
            logger.warning("%s: etcd compacted revisions below %d; resuming there", self._name, compacted)
            self._next = compacted
            return
        try:
            self._next = self._on_compacted() + 1
        except Exception:  # noqa: BLE001 - retried with the next stream
            logger.exception("%s: re-reading after a compaction failed", self._name)
