"""Watches: every change to a key range, in order, across etcd restarts and failovers.

etcd sends a watcher each change with its revision. A stream can break (etcd
restarts, a member fails, the connection drops); etcd keeps the history, so a
watch that reopens from the revision after the last event it delivered loses
nothing and repeats nothing.

All watches of one :class:`EtcdClient` share one stream (a :class:`WatchHub`, as
etcd's own Go client does): an open gRPC stream costs a Python client CPU time
even when idle, and a node agent holds several watches. The hub's thread reads
the stream, hands each watch its events, and when the stream breaks reopens it
(on the next endpoint if need be) and re-creates every watch from where it was.
"""

from __future__ import annotations

import collections
import logging
import queue
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from elastictrain.errors import EtcdError
from elastictrain.etcd.client import EtcdClient, import_etcd3
from elastictrain.etcd.kv import KeyValue, prefix_end

logger = logging.getLogger(__name__)
_JITTER = random.Random()  # never the global one: a trainer's random numbers are its own

__all__ = ["Watch", "WatchEvent", "WatchHub"]

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
        client: The etcd front; its hub carries the watch.
        key: The key, or the prefix with ``prefix=True``.
        prefix: Watch every key that starts with ``key``.
        start_revision: The first revision to deliver (usually a read's revision + 1).
        on_events: Called on the hub's thread with each batch of events, in revision
            order, and the store revision the batch was sent at. It must be quick; an
            exception it raises is logged and the watch goes on.
        on_compacted: Called when etcd no longer holds the next revision (compacted):
            re-read the range and return the revision the read saw; the watch resumes
            after it. Without it, the watch resumes at the compaction point.
        name: Names the watch in log lines.
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
        self._hub = client.watch_hub()
        self.key = key.encode()
        self.range_end = prefix_end(key) if prefix else b""
        self.next_revision = max(1, start_revision)
        """The revision the watch delivers next."""
        self._on_events = on_events
        self._on_compacted = on_compacted
        self.name = name
        self.closed = False

    def start(self) -> Watch:
        self._hub.add(self)
        return self

    def close(self) -> None:
        """Stop delivering events (returns at once; a batch being delivered may still finish)."""
        self.closed = True
        self._hub.remove(self)

    def deliver(self, events: list[WatchEvent], revision: int) -> None:
        fresh = [e for e in events if e.revision >= self.next_revision]  # never deliver one twice
        if not fresh or self.closed:
            return
        self.next_revision = fresh[-1].revision + 1
        try:
            self._on_events(fresh, revision)
        except Exception:
            logger.exception("%s: event handler failed", self.name)

    def compacted(self, compact_revision: int) -> None:
        if self._on_compacted is None:
            logger.warning("%s: etcd compacted revisions below %d; resuming there", self.name, compact_revision)
            self.next_revision = compact_revision
            return
        try:
            self.next_revision = self._on_compacted() + 1
        except Exception:
            logger.exception("%s: re-reading after a compaction failed", self.name)


class WatchHub:
    """The one watch stream of an :class:`EtcdClient`, shared by all its :class:`Watch` es."""

    def __init__(self, client: EtcdClient) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._watches: set[Watch] = set()
        self._by_id: dict[int, Watch] = {}
        self._pending: collections.deque[Watch] = collections.deque()  # creates awaiting "created"
        self._requests: queue.Queue[Any] | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._wake = threading.Event()
        self._call: Any = None

    def add(self, watch: Watch) -> None:
        with self._lock:
            if self._closed:
                return
            self._watches.add(watch)
            if self._requests is not None:
                self._create(watch)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="elastictrain-watches", daemon=True)
                self._thread.start()

    def remove(self, watch: Watch) -> None:
        with self._lock:
            self._watches.discard(watch)
            ids = [i for i, w in self._by_id.items() if w is watch]
            for watch_id in ids:
                del self._by_id[watch_id]
                if self._requests is not None:
                    rpc = import_etcd3().etcdrpc
                    self._requests.put(rpc.WatchRequest(cancel_request=rpc.WatchCancelRequest(watch_id=watch_id)))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._watches.clear()
            requests, call = self._requests, self._call
        self._wake.set()
        if requests is not None:
            requests.put(None)
        if call is not None:
            call.cancel()

    def _create(self, watch: Watch) -> None:
        """Queue a create request for ``watch`` (with the lock held)."""
        rpc = import_etcd3().etcdrpc
        create = rpc.WatchCreateRequest(key=watch.key, start_revision=watch.next_revision)
        if watch.range_end:
            create.range_end = watch.range_end
        self._pending.append(watch)
        assert self._requests is not None  # noqa: S101 - private invariant
        self._requests.put(rpc.WatchRequest(create_request=create))

    @staticmethod
    def _iterate(requests: queue.Queue[Any]) -> Iterator[Any]:
        while True:
            request = requests.get()
            if request is None:
                return
            yield request

    def _run(self) -> None:
        import grpc

        rpc = import_etcd3().etcdrpc
        backoff = _BACKOFF_FIRST
        while True:
            requests: queue.Queue[Any] = queue.Queue()
            with self._lock:
                if self._closed:
                    return
                self._requests, self._by_id = requests, {}
                self._pending.clear()
                for watch in self._watches:
                    self._create(watch)
            call, index, client = None, self._client.current_index, None
            try:
                index, client = self._client.stream_client()
                call = rpc.WatchStub(client.channel).Watch(
                    self._iterate(requests), credentials=client.call_credentials, metadata=client.metadata)
                with self._lock:
                    self._call = call
                for response in call:
                    backoff = _BACKOFF_FIRST
                    self._handle(response)
            except grpc.RpcError as exc:
                with self._lock:
                    if self._closed:
                        return
                logger.debug("watch stream broke (%s); reopening", exc)
                self._client.stream_failed(index, client, exc)
            except ValueError as exc:  # the channel was closed under us
                logger.debug("watch stream: channel closed (%s); reopening", exc)
            except EtcdError as exc:  # no client could be built (e.g. a bad certificate)
                logger.debug("cannot open a watch stream: %s", exc)
            finally:
                requests.put(None)
                if call is not None:
                    call.cancel()
                with self._lock:
                    self._requests = None
            if self._wake.wait(backoff * _JITTER.uniform(0.5, 1.0)):
                return
            backoff = min(backoff * 2, _BACKOFF_MAX)

    def _handle(self, response: Any) -> None:
        watch: Watch | None
        with self._lock:
            if response.created:
                watch = self._pending.popleft() if self._pending else None
                if watch is not None and watch in self._watches:
                    self._by_id[response.watch_id] = watch
                elif self._requests is not None:  # removed before etcd confirmed it
                    rpc = import_etcd3().etcdrpc
                    self._requests.put(rpc.WatchRequest(
                        cancel_request=rpc.WatchCancelRequest(watch_id=response.watch_id)))
            watch = self._by_id.get(response.watch_id)
        if watch is None:
            return
        if response.compact_revision:
            watch.compacted(int(response.compact_revision))
            with self._lock:  # etcd cancelled it: create it again from the new revision
                self._by_id.pop(response.watch_id, None)
                if watch in self._watches and self._requests is not None:
                    self._create(watch)
            return
        if response.canceled:
            logger.debug("%s: etcd cancelled the watch (%s)", watch.name, response.cancel_reason)
            with self._lock:
                self._by_id.pop(response.watch_id, None)
                if watch in self._watches and self._requests is not None:
                    self._create(watch)
            return
        if response.events:
            events = [WatchEvent(bool(e.type == 1), KeyValue.from_pb(e.kv)) for e in response.events]
            watch.deliver(events, int(response.header.revision))
