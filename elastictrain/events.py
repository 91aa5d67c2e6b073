"""Machine-readable events of a run: JSON lines in a file and on ``elastictrain.events``.

Agents and workers of a run append to the same file (``ELASTICTRAIN_EVENT_LOG``,
set by ``elastictrain run`` for its workers): one JSON object per line with
``ts`` (unix seconds), ``kind``, ``run_id``, ``node``, ``pid`` and the event's
own fields. Each line is written with one ``write()`` on a file opened for
appending, so lines from several processes on one machine never interleave.

Kinds written by elastictrain: ``rendezvous`` (round, world size, duration),
``membership_change`` (old -> new world size), ``spare`` (the round is full: this node
waits to replace one that leaves), ``worker_failure``, ``hang``, ``recovery``, ``restart``,
``stop_requested``, ``job_end``, and from the training session ``checkpoint_commit``,
``restore`` and ``session_end`` (the steps trained) (rank 0; an async save reports
``checkpoint_save`` when copied), ``checkpoint_abandoned`` (a save that could not write, or
that a re-formation abandoned: ``step``, ``reason``, and ``next_step`` for the latter),
``checkpoint_skipped`` (a save due while the one in flight gets no answer from its storage),
``straggler``/``straggler_recovered``, ``slow_between_steps``, ``cut_off`` and ``session_failed``
(each rank whose session failed: its committed step, for the steps a restart redoes). A
``recovery`` or ``restart`` event whose cause another node saw carries it as ``fault`` (rank,
node name, node rank, how it ended; :class:`elastictrain._fault.Fault`).
``worker_failure`` gives each failed worker's recorded error, location, trimmed traceback and
whether a peer's failure caused it (the run summary reads them).
torch's own agent events arrive as ``torch_agent``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["EVENT_LOG_ENV", "EventLog", "LineTail", "emit", "event_log", "route_torch_events"]

EVENT_LOG_ENV = "ELASTICTRAIN_EVENT_LOG"
NODE_ENV = "ELASTICTRAIN_NODE_NAME"

logger = logging.getLogger("elastictrain.events")


class EventLog:
    """Appends events of one run to a JSON-lines file and to ``elastictrain.events``.

    Args:
        path: The file; ``None`` logs only.
        run_id: Stamped on every event.
        node: Names this node (default: the hostname).
    """

    def __init__(self, path: str | None, run_id: str, node: str | None = None) -> None:
        self.path = path
        self.run_id = run_id
        self.node = node or os.environ.get(NODE_ENV) or socket.gethostname()
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Record one event; never raises (an event log must not break training)."""
        event = {"ts": round(time.time(), 6), "kind": kind, "run_id": self.run_id,
                 "node": self.node, "pid": os.getpid(), **fields}
        try:
            line = json.dumps(event, default=str) + "\n"
            logger.info("%s", line.rstrip())
            if self._fd is not None:
                with self._lock:
                    os.write(self._fd, line.encode())
        except Exception:
            logger.debug("could not write event %s", kind, exc_info=True)
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                logger.debug("event listener failed on %s", kind, exc_info=True)
        return event

    def add_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Call ``listener`` with every event emitted from now on (e.g. the metrics endpoint)."""
        self._listeners.append(listener)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


class LineTail:
    """Follows a file that other processes append lines to (an event log, a chaos run's evidence).

    Args:
        path: The file; it may not exist yet.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def new_lines(self) -> list[bytes]:
        """The complete lines appended since the last call (a line still being written comes with
        the call after it is finished).

        Raises:
            OSError: The file cannot be read (``FileNotFoundError``: not written yet).
        """
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        return lines


_process_log: EventLog | None = None


def event_log() -> EventLog:
    """This process's event log, from ``ELASTICTRAIN_EVENT_LOG`` (log-only if unset)."""
    global _process_log
    if _process_log is None:
        _process_log = EventLog(os.environ.get(EVENT_LOG_ENV), os.environ.get("TORCHELASTIC_RUN_ID", ""))
    return _process_log


def emit(kind: str, **fields: Any) -> dict[str, Any]:
    """Record an event in this process's event log (see :func:`event_log`)."""
    return event_log().emit(kind, **fields)


class _TorchEventHandler(logging.Handler):
    """Receives torch's serialized elastic events and re-emits them as ours."""

    def __init__(self, log: EventLog, kind: str) -> None:
        super().__init__()
        self._log = log
        self._kind = kind

    def emit(self, record: logging.LogRecord) -> None:
        try:
            payload = json.loads(record.getMessage())
        except ValueError:
            return
        self._log.emit(self._kind, torch=payload)


def route_torch_events(log: EventLog) -> str:
    """Send torch elastic's agent events to ``log``.

    Returns:
        The destination name to pass as ``WorkerSpec.event_log_handler``.
    """
    from elastictrain._torch_compat import event_log_handlers

    event_log_handlers()["elastictrain"] = _TorchEventHandler(log, "torch_agent")
    return "elastictrain"
