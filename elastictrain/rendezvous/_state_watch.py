"""Wake a waiting rendezvous the moment its etcd state changes.

torch's rendezvous loop polls: whenever a node must wait for others it sleeps one
second (``_delay(seconds=1)``) and serves state from a one-second cache. Every
join, recovery and scale-up therefore pays up to a second or two of idle
waiting per round. etcd can tell us when the state key changes, so while one of
our handlers runs a rendezvous operation that sleep becomes "wait for a newer
revision of the state key, at most one second", and the cache is bypassed.

The hook is installed into torch's module (torch 2.13 is pinned; the tests
cover it) and only acts on threads inside an ``etcd3`` rendezvous operation:
other backends in the same process keep torch's behaviour exactly.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from elastictrain.etcd.client import EtcdClient

logger = logging.getLogger(__name__)

__all__ = ["StateWatch", "install", "waiting_on"]

_local = threading.local()


class StateWatch:
    """Tracks the newest ``mod_revision`` of one etcd key through a watch.

    If the watch cannot be set up or breaks (e.g. etcd restarts), waits fall
    back to short polls of the key, so a wait is never longer than torch's.
    """

    _POLL = 0.05

    def __init__(self, client: EtcdClient, key: str) -> None:
        self._client = client
        self._key = key
        self._cond = threading.Condition()
        self._revision = 0
        self._watch: tuple[Any, int] | None = None

    def _on_response(self, response: Any) -> None:
        events = getattr(response, "events", None)
        with self._cond:
            if events is None:  # an error object: the stream is gone
                self._watch = None
            else:
                for event in events:
                    self._revision = max(self._revision, event.mod_revision)
            self._cond.notify_all()

    def _ensure_watch(self) -> bool:
        with self._cond:
            if self._watch is not None:
                return True
        try:
            def register(raw: Any) -> tuple[Any, int]:
                return raw, raw.add_watch_callback(self._key, self._on_response)

            watch = self._client.call(register, what="watching the rendezvous state")
        except Exception as exc:  # noqa: BLE001 - polling still works without a watch
            logger.debug("cannot watch %s (%s); polling instead", self._key, exc)
            return False
        with self._cond:
            self._watch = watch
        return True

    def wait_newer(self, than: int, timeout: float) -> bool:
        """Wait until the key's revision exceeds ``than``, at most ``timeout`` seconds.

        Returns:
            ``True`` if a newer revision was seen, ``False`` on timeout.
        """
        deadline = time.monotonic() + timeout
        if self._ensure_watch():
            with self._cond:
                newer = self._cond.wait_for(lambda: self._revision > than or self._watch is None, timeout)
                if self._watch is not None:
                    return bool(newer)
        while time.monotonic() < deadline:  # the watch is gone: poll
            time.sleep(min(self._POLL, max(0.0, deadline - time.monotonic())))
            try:
                _, meta = self._client.call(lambda c: c.get(self._key), what="polling the rendezvous state")
            except Exception:  # noqa: BLE001 - the caller's next sync reports etcd errors
                return False
            if meta is not None and meta.mod_revision > than:
                return True
        return False

    def close(self) -> None:
        with self._cond:
            watch, self._watch = self._watch, None
        if watch is not None:
            raw, watch_id = watch
            with contextlib.suppress(Exception):
                raw.cancel_watch(watch_id)


@contextlib.contextmanager
def waiting_on(wait: Callable[[float], None]) -> Iterator[None]:
    """Within this block, torch's rendezvous polls on this thread call ``wait(seconds)``."""
    previous = getattr(_local, "wait", None)
    _local.wait = wait
    try:
        yield
    finally:
        _local.wait = previous


def in_rendezvous_operation() -> bool:
    return getattr(_local, "wait", None) is not None


def install() -> None:
    """Route torch's rendezvous poll delay through :func:`waiting_on` (idempotent)."""
    original = dynamic_rendezvous._delay  # noqa: SLF001
    if getattr(original, "_elastictrain", False):
        return

    def delay(seconds: float | tuple[float, float]) -> None:
        wait = getattr(_local, "wait", None)
        if wait is None or isinstance(seconds, tuple):  # not ours, or torch's start-up jitter
            original(seconds)
        else:
            wait(seconds)

    delay._elastictrain = True  # type: ignore[attr-defined]
    dynamic_rendezvous._delay = delay  # noqa: SLF001
