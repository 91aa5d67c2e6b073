"""Storage calls that may block (a hung NFS server) without holding a save forever: :class:`BoundedCalls`.

A thread blocked in a system call cannot be interrupted from Python. So each piece of a save's
storage work runs on a thread of its own, and the save waits for it only while it makes
progress: a call that goes ``timeout`` seconds without progress (a chunk written, or the call
returning) is abandoned. The save then fails like a failed write (``StorageStalledError`` is an
``OSError``), and while the abandoned call has not returned, no other call is started: a hung
mount gets one blocked thread per rank, never a pile of them.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["BoundedCalls", "StorageStalledError"]

T = TypeVar("T")

_POLL = 0.25
"""How often a waiting save looks at the call's progress (seconds)."""


class StorageStalledError(TimeoutError):
    """A storage call made no progress within the bound, or one abandoned earlier still blocks."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ETIMEDOUT, message)

    def __str__(self) -> str:
        return str(self.strerror)


class _Call:
    def __init__(self, what: str) -> None:
        self.what = what
        self.started = time.time()
        self.thread: threading.Thread | None = None


class BoundedCalls:
    """Runs storage calls on helper threads, waiting for each while it makes progress.

    Args:
        timeout: Seconds a call may go without progress before it is abandoned.
    """

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._last = time.monotonic()
        self._running = False
        self._stuck: _Call | None = None

    @property
    def timeout(self) -> float:
        """Seconds a call may go without progress."""
        return self._timeout

    def progress(self) -> None:
        """Note progress of the call in flight (a chunk written); callable from its thread."""
        self._last = time.monotonic()

    def stalled_for(self) -> float:
        """Seconds the call in flight (or an abandoned one that still blocks) has gone without
        progress; 0 when no call is in flight."""
        if self.stuck() is not None or self._running:
            return max(0.0, time.monotonic() - self._last)
        return 0.0

    def stuck(self) -> str | None:
        """What an abandoned call that has still not returned was doing, and since when; else None."""
        call = self._stuck
        if call is None:
            return None
        if call.thread is not None and not call.thread.is_alive():
            self._stuck = None  # it returned after all: storage works again
            return None
        return f"{call.what} has not returned since {time.strftime('%H:%M:%S', time.localtime(call.started))}"

    def run(self, what: str, fn: Callable[[], T], *, timeout: float | None = None,
            cancelled: Callable[[], bool] | None = None) -> T:
        """Return ``fn()``, run on a helper thread, once it returns.

        Args:
            what: Names the call in errors (``the write of step 20``).
            timeout: This call's bound, if not the usual one.
            cancelled: Checked while the call runs: once it returns True (the group that saves
                re-forms), the call is abandoned at once, as one past its bound.

        Raises:
            StorageStalledError: ``fn`` made no progress for ``timeout`` seconds (it is abandoned:
                its thread goes on, and no call starts until it has returned), or an abandoned
                call still blocks (``fn`` is not started).
            Exception: What ``fn`` raised.
        """
        stuck = self.stuck()
        if stuck is not None:
            raise StorageStalledError(f"{what} not started: {stuck} (the storage blocks)")
        call = _Call(what)
        done = threading.Event()
        outcome: list[object] = []

        def target() -> None:
            try:
                outcome.append(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                outcome.append(exc)
            finally:
                done.set()

        # A daemon: a call blocked in the kernel must not keep the process from exiting.
        call.thread = threading.Thread(target=target, name="elastictrain-storage", daemon=True)
        bound = self._timeout if timeout is None else timeout
        self._last = time.monotonic()
        self._running = True
        try:
            call.thread.start()
            while not done.wait(_POLL):
                if time.monotonic() - self._last > bound:
                    self._stuck = call
                    raise StorageStalledError(f"{what} made no progress for {bound:g}s (the storage "
                                              "blocks); abandoned")
                if cancelled is not None and cancelled():
                    self._stuck = call
                    raise StorageStalledError(f"{what} abandoned: a rank is gone, or the group re-forms")
        finally:
            self._running = False
        result = outcome[0]
        if isinstance(result, BaseException):
            raise result
        return result  # type: ignore[return-value]
