"""Handler set-up for elastictrain's own processes (agent, launcher, etcd).

Only :mod:`elastictrain.launch.cli` calls :func:`setup`; library modules just use
``logging.getLogger(__name__)``.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["forget", "setup"]


class _WorkerFailureFilter(logging.Filter):
    """Drops torch's own report of a failed worker (``failed (exitcode: 1) ...`` with the
    wrapped traceback of every failed rank, survivors' consequential errors included): the
    launcher reports the failure itself, root cause first and its traceback once (see
    :mod:`elastictrain.launch.failure_report`). ``--debug`` keeps torch's report."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "torch.distributed.elastic.multiprocessing.api"
                    and isinstance(record.msg, str) and record.msg.startswith("failed (exitcode"))


_OURS, _TORCH_ELASTIC, _EVENTS = "elastictrain", "torch.distributed.elastic", "elastictrain.events"
_CONFIGURED = (_OURS, _TORCH_ELASTIC, _EVENTS)
"""The loggers :func:`setup` configures (and :func:`forget` resets)."""


def setup(*, debug: bool = False, node: str | None = None) -> None:
    """Send elastictrain's logs to stderr with a ``[elastictrain node=...]`` prefix."""
    level = logging.DEBUG if debug else getattr(logging, os.environ.get("ELASTICTRAIN_LOG_LEVEL", "INFO").upper(), logging.INFO)
    prefix = f"[elastictrain{' ' + node if node else ''}]"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{prefix} %(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    root = logging.getLogger(_OURS)
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    # torch's log formatter imports torch's whole compiler stack to format a record that
    # carries an exception, and torch's agent logs every worker failure that way:
    # measured 2.2-3.5 s before the agent even reacted to a crash. A plain formatter
    # on torch's elastic loggers says the same in microseconds.
    elastic = logging.getLogger(_TORCH_ELASTIC)
    elastic_handler = logging.StreamHandler(sys.stderr)
    elastic_handler.setFormatter(logging.Formatter("%(levelname).1s%(asctime)s %(process)d %(name)s] %(message)s"))
    if not debug:
        elastic_handler.addFilter(_WorkerFailureFilter())
    elastic.handlers[:] = [elastic_handler]
    elastic.propagate = False
    # Events go to the run's JSON-lines file; on the terminal they would drown the
    # log, so they show there only with --debug.
    logging.getLogger(_EVENTS).propagate = debug


def forget() -> None:
    """Undo :func:`setup` in a process forked from one that called it (the workers'
    forkserver): a worker configures its own logging, or the session does."""
    for name in _CONFIGURED:
        log = logging.getLogger(name)
        log.handlers[:] = []
        log.setLevel(logging.NOTSET)
        log.propagate = True
